"""The one place where exceptions become gRPC status codes (and request metrics are counted).

Caller mistakes never surface as a bare INTERNAL: domain errors map to precise codes, and
INVALID_ARGUMENT carries the offending field both in the message and in the trailing
metadata key ``loraplex-field``. Anything unexpected is logged with its traceback and
returned as INTERNAL with a short message.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from loraplex.adapter_store.errors import FIELD_METADATA_KEY, field_of, status_of
from loraplex.inference_server.edge.metrics import ServerMetrics

log = logging.getLogger(__name__)
# A client whose deadline passes cancels its call at once; the server's copy of that deadline
# was set when the call arrived, so it passes a transit later: the cancellation lands while the
# server still sees a few ms left. A call cancelled this close to its deadline ended by it.
DEADLINE_SLACK_S = 0.2


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str, str | None]:
    """(code, message, field) for an exception raised by a servicer or the engine: the status
    its class carries (adapter_store/errors.py), INTERNAL for anything else."""
    status = status_of(exc)
    if status is None:
        return grpc.StatusCode.INTERNAL, f"internal error ({type(exc).__name__}); see the server log", None
    code = grpc.StatusCode[status.grpc]
    message = str(exc) or type(exc).__name__
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        message = f"deadline exceeded: {message}" if str(exc) else "deadline exceeded"
    return code, message, field_of(exc)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Wraps the handlers of loraplex services: maps exceptions, counts requests by code."""

    def __init__(self, metrics: ServerMetrics, service_prefix: str = "/loraplex.") -> None:
        self._metrics = metrics
        self._prefix = service_prefix

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(self._prefix):
            return handler
        name = method.rsplit("/", 1)[-1]
        kinds = (
            ("unary_unary", grpc.unary_unary_rpc_method_handler),
            ("unary_stream", grpc.unary_stream_rpc_method_handler),
            ("stream_unary", grpc.stream_unary_rpc_method_handler),
            ("stream_stream", grpc.stream_stream_rpc_method_handler),
        )
        for attr, make in kinds:
            behavior = getattr(handler, attr)
            if behavior is not None:
                return make(
                    self._wrap(behavior, name),
                    request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer,
                )
        return handler

    def _wrap(self, behavior: Callable[..., Any], name: str) -> Callable[..., Any]:
        if inspect.isasyncgenfunction(behavior):
            async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
                rpc = _Observed(self._metrics, name)
                try:
                    try:
                        async for item in behavior(request, context):
                            yield item
                        return
                    except BaseException as exc:  # noqa: BLE001  (re-raised or turned into a status)
                        rpc.code = _code_name(exc, context)
                        status = _status_or_reraise(exc, context, name, rpc.code)
                    rpc.record()  # before abort sends the status: a client that saw it finds it counted
                    await context.abort(*status)  # after the except block: see _status_or_reraise
                finally:
                    rpc.record()
            return stream

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            rpc = _Observed(self._metrics, name)
            try:
                try:
                    return await behavior(request, context)
                except BaseException as exc:  # noqa: BLE001
                    rpc.code = _code_name(exc, context)
                    status = _status_or_reraise(exc, context, name, rpc.code)
                rpc.record()
                await context.abort(*status)
            finally:
                rpc.record()
        return unary


class _Observed:
    """One RPC's outcome, recorded in the metrics once: where it ends in an error status, before
    that status is sent; otherwise when the handler is done."""

    def __init__(self, metrics: ServerMetrics, name: str) -> None:
        self._metrics, self._name, self._start = metrics, name, time.perf_counter()
        self.code = "OK"
        self._recorded = False

    def record(self) -> None:
        if not self._recorded:
            self._recorded = True
            self._metrics.observe_rpc(self._name, self.code, time.perf_counter() - self._start)


def _code_name(exc: BaseException, context: grpc.aio.ServicerContext) -> str:
    """The status code name the caller will see, for the request counter."""
    if isinstance(exc, grpc.aio.AbortError):
        code = context.code()
        return code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
    if isinstance(exc, Exception):
        return status_for(exc)[0].name
    # cancelled (CancelledError) or, for a stream, closed (GeneratorExit): by its client or its deadline
    remaining = context.time_remaining()
    return "DEADLINE_EXCEEDED" if remaining is not None and remaining <= DEADLINE_SLACK_S else "CANCELLED"


def _status_or_reraise(exc: BaseException, context: grpc.aio.ServicerContext, method: str,
                       code_name: str) -> tuple[grpc.StatusCode, str]:
    """The (code, message) to abort the call with, from ``exc`` (logged; its field set in the
    trailing metadata); cancellations and aborts propagate. A call its client cancelled (or whose
    deadline passed) is the client's doing: one INFO line, no traceback. The caller aborts after
    its except block, not inside it: an abort raised there would chain ``exc`` (its traceback, and
    the frames that hold, say, an upload's bytes) to the AbortError that gRPC keeps in a reference
    cycle, so they would wait for the cycle collector."""
    if isinstance(exc, asyncio.CancelledError) or not isinstance(exc, Exception):  # a stream closed: GeneratorExit
        gone = "the client cancelled the call" if code_name == "CANCELLED" else "the call's deadline passed"
        log.info("%s %s: %s; its work was stopped", code_name, method, gone)
    if isinstance(exc, (asyncio.CancelledError, grpc.aio.AbortError)) or not isinstance(exc, Exception):
        raise exc
    code, message, field = status_for(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.error("internal error: %s", message, exc_info=exc)
    else:
        log.info("%s: %s", code.name, message)
    if field:
        context.set_trailing_metadata(((FIELD_METADATA_KEY, field),))
    return code, message
