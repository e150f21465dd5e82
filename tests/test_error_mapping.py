"""Every domain error reaches the caller as one precise status code, never bare INTERNAL."""

from __future__ import annotations

import grpc
import pytest

from loraplex.adapter_store.errors import (
    AdapterCorruptError,
    AdapterNotFoundError,
    AdapterValidationError,
    InvalidRequestError,
    ResourceExhaustedError,
    UnavailableError,
)
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
