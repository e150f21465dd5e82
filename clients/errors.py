"""Errors the client raises: one class per gRPC status the server uses on purpose."""

from __future__ import annotations

import grpc

FIELD_METADATA_KEY = "loraplex-field"


class LoraplexClientError(Exception):
    """A failed call. ``code`` is the gRPC status, ``field`` the offending request field (if any)."""

    def __init__(self, code: grpc.StatusCode, details: str, field: str | None = None) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code
        self.details = details
        self.field = field


class InvalidArgumentError(LoraplexClientError, ValueError):
    """The request was wrong; ``field`` names the part (e.g. ``sampling.top_p``)."""


class NotFoundError(LoraplexClientError, LookupError):
    """Unknown adapter."""


class ResourceExhaustedError(LoraplexClientError):
    """The server's queue or a size limit is full; retry later or send less."""


class UnavailableError(LoraplexClientError):
    """The server is loading, shutting down or unreachable."""


class TransportMismatchError(UnavailableError):
    """The connection failed because client and port speak different transports (plaintext to a
    TLS port, TLS to a plaintext one, gRPC to a port that answers in HTTP/1.1) or the server's
    certificate is not trusted; the message names the fix (e.g. "this port speaks TLS: pass
    --tls-root-cert"). Waiting will not help."""


class DeadlineExceededError(LoraplexClientError, TimeoutError):
    """The call's timeout passed."""


class CancelledError(LoraplexClientError):
    """The call was cancelled."""


class UnauthenticatedError(LoraplexClientError):
    """No token, or a token the server does not know (give --token / LORAPLEX_TOKEN)."""


class PermissionDeniedError(LoraplexClientError):
    """The token is valid but may not do this (e.g. write outside its tenant's namespace)."""


class ClientClosedError(LoraplexClientError, RuntimeError):
    """A call on a client after ``close()`` (or after its ``with`` block): make a new client."""

    def __init__(self) -> None:
        super().__init__(grpc.StatusCode.FAILED_PRECONDITION,
                         "this client is closed (close() was called or its with-block ended): make a new one")


_BY_CODE: dict[grpc.StatusCode, type[LoraplexClientError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: CancelledError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
}


def from_rpc_error(error: grpc.RpcError) -> LoraplexClientError:
    """The client error for a grpc.RpcError (sync) or grpc.aio.AioRpcError."""
    code = error.code() if callable(getattr(error, "code", None)) else grpc.StatusCode.UNKNOWN
    details = error.details() if callable(getattr(error, "details", None)) else str(error)
    field = None
    trailing = error.trailing_metadata() if callable(getattr(error, "trailing_metadata", None)) else None
    for key, value in trailing or ():
        if key == FIELD_METADATA_KEY:
            field = value
    return _BY_CODE.get(code, LoraplexClientError)(code, details or "", field)
