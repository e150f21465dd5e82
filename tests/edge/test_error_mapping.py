"""Every domain error reaches the caller as one precise status code, never bare INTERNAL; the
gRPC code and the HTTP status both come from the one table, the status each class carries."""

from __future__ import annotations

import grpc
import pytest

from loraplex.adapter_store.errors import (
    AdapterCorruptError,
    AdapterNotFoundError,
    AdapterValidationError,
    ContextLengthExceededError,
    InvalidRequestError,
    PermissionDeniedError,
    ResourceExhaustedError,
    StoreRefusedError,
    UnauthenticatedError,
    UnavailableError,
    status_of,
)
from loraplex.inference_server.http.errors import error_for
from loraplex.inference_server.server.interceptor import status_for


@pytest.mark.parametrize(
    ("error", "code", "field"),
    [
        (InvalidRequestError("must be > 0", "top_p"), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        (AdapterValidationError("tensor 'x' has shape [4, 3]"), grpc.StatusCode.INVALID_ARGUMENT, None),
        (AdapterNotFoundError("acme/x"), grpc.StatusCode.NOT_FOUND, None),
        (ResourceExhaustedError("request queue is full"), grpc.StatusCode.RESOURCE_EXHAUSTED, None),
        (UnavailableError("shutting down"), grpc.StatusCode.UNAVAILABLE, None),
        (AdapterCorruptError("acme/x: checksum mismatch"), grpc.StatusCode.DATA_LOSS, None),
    ],
)
def test_domain_errors_map_to_precise_codes(error: Exception, code: grpc.StatusCode, field: str | None) -> None:
    got_code, message, got_field = status_for(error)
    assert (got_code, got_field) == (code, field)
    assert str(error) in message


def test_an_unexpected_exception_is_internal_without_leaking_details() -> None:
    code, message, _ = status_for(RuntimeError("secret path /etc/x"))
    assert code == grpc.StatusCode.INTERNAL and "secret" not in message


@pytest.mark.parametrize(("error", "code", "http"), [
    (InvalidRequestError("must be > 0", "top_p"), grpc.StatusCode.INVALID_ARGUMENT, 400),
    (ContextLengthExceededError("too long", "prompt"), grpc.StatusCode.INVALID_ARGUMENT, 400),
    (AdapterNotFoundError("acme/x"), grpc.StatusCode.NOT_FOUND, 404),
    (ResourceExhaustedError("request queue is full"), grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
    (UnavailableError("shutting down"), grpc.StatusCode.UNAVAILABLE, 503),
    (StoreRefusedError("the store refuses the secret"), grpc.StatusCode.UNAVAILABLE, 503),
    (UnauthenticatedError("no token"), grpc.StatusCode.UNAUTHENTICATED, 401),
    (PermissionDeniedError("not yours"), grpc.StatusCode.PERMISSION_DENIED, 403),
    (AdapterCorruptError("acme/x: checksum mismatch"), grpc.StatusCode.DATA_LOSS, 500),
    (TimeoutError(), grpc.StatusCode.DEADLINE_EXCEEDED, 504),
])
def test_both_edges_read_the_status_the_error_carries(error: Exception, code: grpc.StatusCode, http: int) -> None:
    carried = status_of(error)
    assert carried is not None and grpc.StatusCode[carried.grpc] == code and carried.http == http
    assert status_for(error)[0] == code
    status, body = error_for(error)
    assert status == http and (body["error"]["type"], body["error"]["code"]) == (carried.kind, carried.code)


def test_an_unexpected_exception_is_500_over_http_too() -> None:
    assert status_of(RuntimeError("x")) is None
    status, body = error_for(RuntimeError("secret path /etc/x"))
    assert status == 500 and "secret" not in body["error"]["message"]
