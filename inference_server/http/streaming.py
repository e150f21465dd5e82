"""Server-Sent Events: ``data: {json}`` chunks and ``data: [DONE]``, and the response that
closes the generation when the client goes away.

Headers go out only after the first event, so every refusal (unknown adapter, full queue,
quota) is still a proper HTTP status; an error after that arrives as one ``data:
{"error": ...}`` event, as vLLM sends it, followed by ``[DONE]``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from typing import Protocol

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from loraplex.adapter_store.errors import ClientDisconnectedError, LoraplexError
from loraplex.inference_server.engine.request import FinishReason, TokenEvent, Usage
from loraplex.inference_server.http.errors import error_body, error_for

DONE = b"data: [DONE]\n\n"


class ChunkFormat(Protocol):
    def chunk(self, event: TokenEvent, index: int = 0) -> dict: ...

    def usage_chunk(self, usage: Usage) -> dict: ...

    def total_usage(self, usages: dict[int, Usage]) -> Usage: ...


def sse(obj: dict) -> bytes:
    """One event: ``data: <compact JSON>`` and a blank line."""
    return b"data: " + json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


async def sse_events(events: AsyncIterator[tuple[int, TokenEvent]], fmt: ChunkFormat,
                     include_usage: bool) -> AsyncIterator[bytes]:
    """The stream's bytes: each (choice index, event) of ``events`` as a chunk, the usage chunk
    when asked for (``stream_options.include_usage``: every choice's tokens, each prompt once),
    then [DONE]."""
    usages: dict[int, Usage] = {}
    async with aclosing(events):  # type: ignore[type-var]
        try:
            async for index, event in events:
                if event.finish_reason is FinishReason.ERROR:
                    yield sse(error_body("the engine failed this request; see the server log", "server_error",
                                         None, "internal_error"))
                    break
                yield sse(fmt.chunk(event, index))
                if event.usage is not None:
                    usages[index] = event.usage
        except (LoraplexError, TimeoutError) as exc:
            yield sse(error_for(exc)[1])
    if include_usage and usages:
        yield sse(fmt.usage_chunk(fmt.total_usage(usages)))
    yield DONE


class EventStreamResponse(StreamingResponse):
    """A text/event-stream response whose body iterator is closed however the response ends:
    a client that disconnects cancels the send, and closing the iterator then aborts the
    generation in the engine at once rather than when the garbage collector finds it.
    ``on_end(status)`` is called once it ends: 200 when every chunk went out, 499 when the client
    hung up first, 500 when the stream failed."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncGenerator[bytes, None], headers: dict[str, str] | None = None) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **(headers or {})})
        self._content = content
        self._whole = False
        self.on_end: Callable[[int], None] = lambda status: None

    async def stream_response(self, send: Send) -> None:
        await super().stream_response(send)
        self._whole = True  # every chunk, and the end of the body, went out

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        status = 500
        try:
            await super().__call__(scope, receive, send)
            status = 200 if self._whole else ClientDisconnectedError.status.http
        finally:
            await self._content.aclose()
            self.on_end(status)
