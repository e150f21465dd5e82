"""The error vocabulary the store and the inference server share, and the store's own.

Each domain class carries its status (``ErrorStatus``: the gRPC status code, the HTTP status
and OpenAI's error type and code), the one table every edge reads through ``status_of``: the
server's gRPC interceptor, its HTTP edge and the store's service; the store client turns a
store's status back into the same class. A refusal's field travels in the trailing metadata
key ``FIELD_METADATA_KEY`` (the server side of the wire defines it here, once)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

FIELD_METADATA_KEY = "loraplex-field"  # trailer: the field an INVALID_ARGUMENT names


@dataclass(frozen=True, slots=True)
class ErrorStatus:
    """What an error becomes at the edges: ``grpc`` a grpc.StatusCode name, ``http`` the HTTP
    status, ``kind`` and ``code`` the OpenAI error body's ``type`` and ``code``."""

    grpc: str
    http: int
    kind: str
    code: str | None = None


DEADLINE_EXCEEDED = ErrorStatus("DEADLINE_EXCEEDED", 504, "timeout_error", "deadline_exceeded")


class LoraplexError(Exception):
    """Base class of every error loraplex raises on purpose. ``status`` None: no precise status
    (the edges answer INTERNAL / 500, as for any unexpected exception)."""

    status: ClassVar[ErrorStatus | None] = None


def status_of(exc: BaseException) -> ErrorStatus | None:
    """The status ``exc`` carries (a TimeoutError: DEADLINE_EXCEEDED); None: a fault of the
    server, which the edges log with its traceback and answer INTERNAL / 500."""
    if isinstance(exc, LoraplexError):
        return exc.status
    if isinstance(exc, TimeoutError):
        return DEADLINE_EXCEEDED
    return None


class InvalidRequestError(LoraplexError, ValueError):
    """A caller's mistake (INVALID_ARGUMENT). ``field`` names the offending field."""

    status = ErrorStatus("INVALID_ARGUMENT", 400, "invalid_request_error")

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field


def field_of(exc: BaseException) -> str | None:
    """The request field a refusal names (InvalidRequestError's ``field``); None for others."""
    return exc.field if isinstance(exc, InvalidRequestError) else None

class ContextLengthExceededError(InvalidRequestError):
    """A prompt, or a prompt plus the tokens asked for, does not fit the context window
    (INVALID_ARGUMENT; OpenAI's ``context_length_exceeded`` on the HTTP edge)."""

    status = ErrorStatus("INVALID_ARGUMENT", 400, "invalid_request_error", "context_length_exceeded")


class AdapterNotFoundError(LoraplexError, LookupError):
    """The adapter id does not name a stored adapter (NOT_FOUND)."""

    status = ErrorStatus("NOT_FOUND", 404, "invalid_request_error", "model_not_found")

    def __init__(self, adapter_id: str, field: str | None = None) -> None:
        super().__init__(f"adapter {adapter_id!r} not found")
        self.adapter_id = adapter_id
        self.field = field  # the request field that named it, where not the model (HTTP's param)


class AdapterValidationError(InvalidRequestError):
    """An adapter is malformed, unsupported, or does not fit the base model."""


class ResourceExhaustedError(LoraplexError):
    """A limit was hit (queue full, quota); the message says which (RESOURCE_EXHAUSTED)."""

    status = ErrorStatus("RESOURCE_EXHAUSTED", 429, "rate_limit_error", "rate_limit_exceeded")


class DataLossError(LoraplexError):
    """Stored bytes failed their checksum and are never served (DATA_LOSS)."""

    status = ErrorStatus("DATA_LOSS", 500, "server_error", "data_loss")


class UnavailableError(LoraplexError):
    """A dependency is down or the server is shutting down (UNAVAILABLE)."""

    status = ErrorStatus("UNAVAILABLE", 503, "service_unavailable_error", "unavailable")


class StoreRefusedError(UnavailableError):
    """The adapter store refused the inference server's own calls (UNAUTHENTICATED at the store):
    the shared secret is missing or wrong. The server is set up wrong, not its caller, so its
    clients get UNAVAILABLE."""


class UnauthenticatedError(LoraplexError):
    """No credentials, or credentials that name nobody (UNAUTHENTICATED)."""

    status = ErrorStatus("UNAUTHENTICATED", 401, "authentication_error", "invalid_api_key")


class PermissionDeniedError(LoraplexError):
    """The caller is known but may not do this (PERMISSION_DENIED)."""

    status = ErrorStatus("PERMISSION_DENIED", 403, "permission_error", "permission_denied")


class ClientDisconnectedError(LoraplexError):
    """The caller hung up (closed its connection, cancelled its call) before its answer was
    complete: the client's doing, never a server fault. CANCELLED; over HTTP 499, the status
    nginx logs for a client that closed its request."""

    status = ErrorStatus("CANCELLED", 499, "client_disconnect", "client_closed_request")


# The store's own.


class AdapterCorruptError(DataLossError):
    """Stored bytes failed their checksum (or went missing); they are never served (DATA_LOSS)."""


class BackendUnavailable(Exception):
    """A backend (Redis, S3, the local disk) could not be reached. Internal: the store either
    falls back (and counts it) or turns it into UnavailableError with a message saying why.

    ``fix`` is set when the backend's answer says a setting is wrong rather than that it is down
    (S3: no such bucket, no credentials, credentials refused): waiting will not help, so the
    store refuses to start with it (Store.check_backends)."""

    def __init__(self, backend: str, detail: str, fix: str | None = None) -> None:
        super().__init__(f"{backend} is unreachable: {detail}")
        self.backend = backend
        self.detail = detail
        self.fix = fix


class BlobMissing(LookupError):
    """A blob key that the index points at is not in the blob backend."""


class LeaseLost(Exception):
    """A writer's lease on an adapter id ran out or was taken over before its commit: the write
    must not commit (another writer may have committed since)."""

    def __init__(self, adapter_id: str, why: str) -> None:
        super().__init__(f"the writer lease on {adapter_id!r} was lost: {why}")
        self.adapter_id = adapter_id


class HeadChanged(Exception):
    """A conditional head write or delete found the head changed since it was read: another
    writer committed in between, and this write must not overwrite it."""

    def __init__(self, adapter_id: str) -> None:
        super().__init__(f"the head of {adapter_id!r} changed since it was read")
        self.adapter_id = adapter_id
