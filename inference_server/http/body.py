"""Reading a JSON request body: its content type, a size limit, then its pydantic model.

The limit is checked against Content-Length before anything is read and again while a
chunked body arrives, so a 10 MB body is refused (413) without being buffered whole; a body
that takes longer than its deadline (--http-body-timeout-s) is refused (408). A client
that hangs up before its body is whole is the client's doing (ClientDisconnectedError: 499,
logged once at INFO), not a server fault.
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect, Request

from loraplex.adapter_store.errors import ClientDisconnectedError
from loraplex.inference_server.http.errors import HttpError, invalid_body

M = TypeVar("M", bound=BaseModel)


def _check_content_type(request: Request) -> None:
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise HttpError(415, f"Content-Type must be application/json, got {media_type or 'none'!r}",
                        code="unsupported_media_type")


def _too_large(limit: int) -> HttpError:
    return HttpError(413, f"the request body is larger than this server's limit of {limit} bytes",
                     code="request_too_large", close=True)


async def _read_limited(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


async def read_body(request: Request, model: type[M], limit: int, timeout_s: float) -> M:
    """``request``'s body as ``model``: 415 for another content type, 413 above ``limit`` bytes,
    400 naming the parameter for malformed JSON or a bad field, 408 when the body is not whole
    ``timeout_s`` seconds after the route started reading it (its head's arrival), and
    ClientDisconnectedError (499) when the client hangs up before the body is whole. A 413 or a
    408 closes the connection (the rest of the body may still be on its way)."""
    _check_content_type(request)
    try:
        async with asyncio.timeout(timeout_s):
            raw = await _read_limited(request, limit)
    except TimeoutError:
        raise HttpError(408, f"the request body did not arrive within {timeout_s:g} s", code="request_timeout",
                        close=True) from None
    except ClientDisconnect:
        raise ClientDisconnectedError("the client disconnected before its request body arrived") from None
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise invalid_body(exc) from None
