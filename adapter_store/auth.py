"""The store trusts only the inference server: a shared secret in every call's metadata.

The server sends ``x-loraplex-store-secret: <secret>``; the store compares it in constant
time and answers UNAUTHENTICATED otherwise, so nobody can reach the store's API around the
server's tenant rules. Health checks and reflection stay open (probes need them). The
secret is read from a file (a Kubernetes Secret) and never logged.

A trusted call may also say which tenant it is made for (``x-loraplex-tenant``, and
``x-loraplex-role: tenant|admin``, default tenant): the store then holds it to the server's
tenant rules (adapter_store/tenants/policy.py, applied in service.py): another tenant's
private adapter is NOT_FOUND, public ones are readable, writes outside the caller's
namespace are PERMISSION_DENIED. A call without a caller is the server's own (loading a
Generate's adapter, following changes) and may do anything.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import grpc

from loraplex.adapter_store.errors import InvalidRequestError
from loraplex.adapter_store.protocol import ROLE_METADATA_KEY, SECRET_METADATA_KEY, TENANT_METADATA_KEY
from loraplex.adapter_store.secret import check_secret
from loraplex.adapter_store.tenants.principal import Principal, Role

log = logging.getLogger(__name__)
_OPEN_PREFIXES = ("/grpc.health.", "/grpc.reflection.")


def is_loopback(listen: str) -> bool:
    """Is ``host:port`` a loopback address (localhost, 127.0.0.0/8, ::1)?"""
    host = listen.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def caller_of(metadata: Iterable[tuple[str, str | bytes]] | None) -> Principal | None:
    """The tenant a call is made for, from its metadata (None: the server's own call).
    InvalidRequestError names a malformed value."""
    pairs = list(metadata or ())
    for key in (TENANT_METADATA_KEY, ROLE_METADATA_KEY):
        if sum(k == key for k, _ in pairs) > 1:  # which one counts would be a guess: refuse
            raise InvalidRequestError(f"metadata {key} given more than once")
    values = dict(pairs)
    tenant, role = values.get(TENANT_METADATA_KEY), values.get(ROLE_METADATA_KEY)
    if tenant is None:
        if role is not None:
            raise InvalidRequestError(f"metadata {ROLE_METADATA_KEY} needs {TENANT_METADATA_KEY} (the caller's tenant)")
        return None
    try:
        parsed = Role(role if role is not None else Role.TENANT.value)
    except ValueError:
        raise InvalidRequestError(f"metadata {ROLE_METADATA_KEY} must be 'tenant' or 'admin', got {role!r}") from None
    try:
        return Principal(str(tenant), parsed)
    except ValueError as e:
        raise InvalidRequestError(f"metadata {TENANT_METADATA_KEY}: {e}") from None


class SecretInterceptor(grpc.aio.ServerInterceptor):
    """Refuses every call to the store's own services without the shared secret."""

    def __init__(self, secret: str) -> None:
        check_secret(secret)
        self._secret = secret.encode("ascii")

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        if details.method.startswith(_OPEN_PREFIXES):
            return await continuation(details)
        secrets = [v for k, v in (details.invocation_metadata or ()) if k == SECRET_METADATA_KEY]
        given = secrets[0] if len(secrets) == 1 else ""  # none, or several (one of them right): refused
        given_bytes = given.encode("utf-8", "replace") if isinstance(given, str) else bytes(given)
        if not hmac.compare_digest(given_bytes, self._secret):
            log.warning("audit: store call refused: method=%s outcome=unauthenticated (%s)",
                        details.method, "no secret" if not given else "wrong secret")
            handler = await continuation(details)
            if handler is None:
                return None
            return _deny_like(handler, "the adapter store accepts calls from the inference server only")
        return await continuation(details)


def _deny_like(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as ``handler`` that answers UNAUTHENTICATED."""
    code = grpc.StatusCode.UNAUTHENTICATED

    async def unary(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)

    async def streaming(request: Any, context: grpc.aio.ServicerContext):  # noqa: ANN202
        await context.abort(code, message)
        yield  # pragma: no cover  (makes this an async generator)

    kw = {"request_deserializer": handler.request_deserializer,
          "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(unary, **kw)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(streaming, **kw)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(unary, **kw)
    return grpc.stream_stream_rpc_method_handler(streaming, **kw)
