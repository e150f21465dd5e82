"""The one authentication point: every loraplex RPC's bearer token becomes a Principal.

The handler then sees a context whose ``principal`` attribute names the caller (None when
authentication is off); the servicer applies the policy. A missing or bad token raises
UnauthenticatedError (mapped to UNAUTHENTICATED by the ErrorInterceptor, which must come
first in the interceptor list) and writes an audit line with the method, the peer and the
reason, never the token. Health and reflection need no token (probes).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from loraplex.adapter_store.decoding import checked, lenient
from loraplex.adapter_store.errors import UnauthenticatedError
from loraplex.adapter_store.tenants.principal import Principal
from loraplex.inference_server.auth.tokens import AuthError, TokenFile

AUTH_METADATA_KEY = "authorization"
audit = logging.getLogger("loraplex.audit")


class PrincipalContext:
    """A ServicerContext that also carries the authenticated ``principal``."""

    def __init__(self, context: grpc.aio.ServicerContext, principal: Principal | None) -> None:
        self._context = context
        self.principal = principal

    def peer(self) -> str:
        return self._context.peer()

    def cancelled(self) -> bool:
        return self._context.cancelled()

    def __getattr__(self, name: str) -> Any:  # the rest of grpc.aio.ServicerContext
        return getattr(self._context, name)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Authenticates calls to ``/loraplex.`` services against ``tokens`` (None = off)."""

    def __init__(self, tokens: TokenFile | None, on_failure: Callable[[str], None] = lambda reason: None,
                 service_prefix: str = "/loraplex.") -> None:
        self._tokens = tokens
        self._on_failure = on_failure
        self._prefix = service_prefix

    def _authenticate(self, details: grpc.HandlerCallDetails) -> Principal | None:
        if self._tokens is None:
            return None
        values = [v for k, v in (details.invocation_metadata or ()) if k == AUTH_METADATA_KEY]
        value = values[0] if len(values) == 1 else None
        if len(values) > 1:
            raise AuthError("malformed credentials: more than one authorization value")
        if isinstance(value, bytes):
            raise AuthError("malformed credentials: authorization must be text")
        return self._tokens.authenticate(value)

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self._prefix):
            return handler
        try:
            principal, failure = self._authenticate(details), None
        except AuthError as exc:
            principal, failure = None, str(exc)
        kinds = (("unary_unary", grpc.unary_unary_rpc_method_handler),
                 ("unary_stream", grpc.unary_stream_rpc_method_handler),
                 ("stream_unary", grpc.stream_unary_rpc_method_handler),
                 ("stream_stream", grpc.stream_stream_rpc_method_handler))
        for attr, make in kinds:
            behavior = getattr(handler, attr)
            if behavior is not None:
                return make(self._wrap(behavior, details.method, principal, failure),
                            request_deserializer=lenient(handler.request_deserializer),
                            response_serializer=handler.response_serializer)
        return handler

    def _refuse(self, method: str, context: grpc.aio.ServicerContext, reason: str) -> UnauthenticatedError:
        audit.warning("audit: auth_failure method=%s peer=%s outcome=unauthenticated reason=%r",
                      method, context.peer(), reason)
        self._on_failure(reason.split(":")[0])
        return UnauthenticatedError(reason)

    def _wrap(self, behavior: Callable[..., Any], method: str, principal: Principal | None,
              failure: str | None) -> Callable[..., Any]:
        if inspect.isasyncgenfunction(behavior):
            async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                if failure is not None:
                    raise self._refuse(method, context, failure)
                async for item in behavior(checked(request), PrincipalContext(context, principal)):
                    yield item
            return stream

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if failure is not None:  # authentication first: a body that does not parse is the caller's next problem
                raise self._refuse(method, context, failure)
            return await behavior(checked(request), PrincipalContext(context, principal))
        return unary
