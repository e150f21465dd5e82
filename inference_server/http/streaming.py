"""Server-Sent Events: ``data: {json}`` chunks and ``data: [DONE]``, and the response that
closes the generation when the client goes away.

Headers go out only after the first event, so every refusal (unknown adapter, full queue,
quota) is still a proper HTTP status; an error after that arrives as one ``data:
{"error": ...}`` event, as vLLM sends it, followed by ``[DONE]``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Protocol

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from loraplex.adapter_store.errors import LoraplexError
from loraplex.inference_server.engine.request import FinishReason, TokenEvent, Usage
from loraplex.inference_server.http.errors import error_body, error_for

DONE = b"data: [DONE]\n\n"


class ChunkFormat(Protocol):
    def chunk(self, event: TokenEvent) -> dict: ...

    def usage_chunk(self, usage: Usage) -> dict: ...


def sse(obj: dict) -> bytes:
    """One event: ``data: <compact JSON>`` and a blank line."""
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


async def sse_events(first: TokenEvent, events: AsyncIterator[TokenEvent], fmt: ChunkFormat,
                     include_usage: bool) -> AsyncIterator[bytes]:
    """The stream's bytes: ``first`` (already received), then the rest of ``events``, the usage
    chunk when asked for (``stream_options.include_usage``), then [DONE]."""
    usage = None
    async with aclosing(events):
        try:
            event: TokenEvent | None = first
            while event is not None:
                if event.finish_reason is FinishReason.ERROR:
                    yield sse(error_body("the engine failed this request; see the server log", "server_error",
                                         None, "internal_error"))
                    break
                yield sse(fmt.chunk(event))
                usage = event.usage or usage
                event = await anext(events, None)
        except (LoraplexError, TimeoutError) as exc:
            yield sse(error_for(exc)[1])
    if include_usage and usage is not None:
        yield sse(fmt.usage_chunk(usage))
    yield DONE


class EventStreamResponse(StreamingResponse):
    """A text/event-stream response whose body iterator is closed however the response ends:
    a client that disconnects cancels the send, and closing the iterator then aborts the
    generation in the engine at once rather than when the garbage collector finds it."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncGenerator[bytes, None]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._content = content

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._content.aclose()
