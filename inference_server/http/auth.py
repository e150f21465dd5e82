"""Bearer tokens of HTTP requests -> the same Principal the gRPC edge's interceptor makes.

Tenancy's methods read ``context.principal`` and ``context.peer()``; an HttpCaller is that
context for an HTTP request. A missing or bad token is an UnauthenticatedError (401) with
the same audit line as gRPC's, which never carries the token.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from starlette.requests import Request

from loraplex.adapter_store.errors import UnauthenticatedError
from loraplex.adapter_store.tenants.principal import Principal
from loraplex.inference_server.auth.tokens import AuthError, TokenFile

audit = logging.getLogger("loraplex.audit")


@dataclass(frozen=True, slots=True)
class HttpCaller:
    """Who sent an HTTP request (``principal`` None: authentication is off) and from where."""

    principal: Principal | None
    address: str

    def peer(self) -> str:
        return self.address

    def cancelled(self) -> bool:
        """An HTTP request's hang-up is seen by its response, not here."""
        return False


def _peer(request: Request) -> str:
    client = request.client
    return f"ipv4:{client.host}:{client.port}" if client is not None else "unknown"


def authenticate(request: Request, tokens: TokenFile | None, on_failure: Callable[[str], None]) -> HttpCaller:
    """The caller of ``request``; UnauthenticatedError when tokens are on and it has no valid one."""
    peer = _peer(request)
    if tokens is None:
        return HttpCaller(None, peer)
    values = request.headers.getlist("authorization")
    try:
        if len(values) > 1:
            raise AuthError("malformed credentials: more than one authorization value")
        return HttpCaller(tokens.authenticate(values[0] if values else None), peer)
    except AuthError as exc:
        reason = str(exc)
        audit.warning("audit: auth_failure method=%s peer=%s outcome=unauthenticated reason=%r",
                      f"HTTP {request.url.path}", peer, reason)
        on_failure(reason.split(":")[0])
        raise UnauthenticatedError(reason) from None
