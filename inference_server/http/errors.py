"""Exceptions as HTTP statuses with OpenAI-shaped error bodies.

The body is ``{"error": {"message", "type", "param", "code"}}``, what the openai clients
parse. The status, ``type`` and ``code`` are the ones the error's class carries
(adapter_store/errors.py: the one table, which the gRPC interceptor reads too): a 400 names the
offending parameter in ``param`` (from InvalidRequestError's ``field``; a prompt or a request
past the context window has ``code`` context_length_exceeded, as OpenAI's), an unknown adapter
is a 404 with ``param`` "model" (never a fallback to the base model), a full queue or quota a
429, not ready or draining a 503.
"""

from __future__ import annotations

import logging

from pydantic import ValidationError
from starlette.responses import JSONResponse

from loraplex.adapter_store.errors import AdapterNotFoundError, InvalidRequestError, field_of, status_of

log = logging.getLogger(__name__)


class HttpError(Exception):
    """A refusal of the HTTP layer itself (body too large, wrong content type, no such route, a
    ``lora_path`` naming no stored adapter: a 404 whose ``param`` is not ``model``)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, close: bool = False) -> None:
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code
        self.close = close  # answer with Connection: close (the rest of the request may still be coming)


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_for(exc: Exception) -> tuple[int, dict]:
    """(status, body) for an exception raised while serving a request; unexpected ones are
    logged with their traceback and answered 500 without details."""
    if isinstance(exc, HttpError):
        return exc.status, error_body(str(exc), exc.kind, exc.param, exc.code)
    status = status_of(exc)
    if status is not None:
        param = (exc.field or "model") if isinstance(exc, AdapterNotFoundError) else field_of(exc)
        log.info("HTTP %d: %s", status.http, exc)
        return status.http, error_body(str(exc) or type(exc).__name__, status.kind, param, status.code)
    log.error("internal error serving an HTTP request", exc_info=exc)
    return 500, error_body(f"internal error ({type(exc).__name__}); see the server log", "server_error", None,
                           "internal_error")


def error_response(exc: Exception) -> JSONResponse:
    """The JSON response for ``exc``; a 429 or 503 says when to retry."""
    status, body = error_for(exc)
    headers = {"Retry-After": "1"} if status in (429, 503) else {}
    if isinstance(exc, HttpError) and exc.close:
        headers["Connection"] = "close"
    return JSONResponse(body, status_code=status, headers=headers or None)


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}


def _param_of(loc: tuple) -> str | None:
    """A pydantic error location as an OpenAI ``param``: ``messages[0].content``; the union
    member tags pydantic adds (``str``, ``list[int]``) are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in part or part.lower() in _TYPE_TAGS or part.startswith(("function-", "json-")):
            continue
        else:
            out += f".{part}" if out else part
    return out or None


def invalid_body(exc: ValidationError) -> InvalidRequestError:
    """A body that did not parse as its model, as the InvalidRequestError naming the parameter."""
    first = exc.errors(include_url=False)[0]
    kind = first["type"]
    if kind == "json_invalid":
        return InvalidRequestError(f"the body is not valid JSON ({first['msg']})", None)
    param = _param_of(tuple(first["loc"]))
    if kind == "missing":
        return InvalidRequestError("is required", param)
    if kind == "model_type" and param is None:
        return InvalidRequestError("the body must be a JSON object", None)
    return InvalidRequestError(first["msg"], param)
