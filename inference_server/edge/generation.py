"""One generation's life at an edge, shared by the gRPC servicer and the HTTP edge.

Admission (tenant rules and quotas, the stream limit, draining), metrics and the abort of a
request its caller left are the same whichever protocol the request came in on, so they live
here once: an edge converts its request, iterates ``generation(...)`` and converts each event.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing

from loraplex.adapter_store.errors import LoraplexError
from loraplex.inference_server.edge.checks import counts_prompt
from loraplex.inference_server.edge.caller import Caller
from loraplex.inference_server.edge.metrics import ServerMetrics
from loraplex.inference_server.edge.state import ServingState
from loraplex.inference_server.edge.tenancy import Tenancy
from loraplex.inference_server.engine.api import ServingEngine
from loraplex.inference_server.engine.request import FinishReason, GenerationRequest, TokenEvent


async def generation(state: ServingState, metrics: ServerMetrics, tenancy: Tenancy, context: Caller,
                     engine: ServingEngine, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
    """Stream ``request``'s events from ``engine`` on behalf of ``context``'s caller. Refusals
    (unknown adapter, quota, full queue, draining) raise before the first event; a stream closed
    or cancelled before its last event (its caller left) aborts the request in the engine at
    once, freeing its slot and KV blocks, and counts it in the finished requests as ``abort``.
    Iterate it inside ``contextlib.aclosing`` so an edge that stops early closes it at once."""
    async with tenancy.generation(context, engine, request) as (req, ticket), state.stream(req.request_id):
        prompt = len(req.prompt_token_ids) if counts_prompt(req) else 0
        track = metrics.stream(req.adapter_id, prompt)
        stream = engine.generate(req)
        finished = refused = False
        metrics.active_streams.inc()  # admitted: until its last event, its refusal or its abort
        try:
            async for event in stream:
                if track.admit():  # counted as the engine takes it: a refusal raises before any event
                    tenancy.admitted(ticket, prompt)
                track.tokens(len(event.token_ids))
                tenancy.generated(ticket, len(event.token_ids))
                if event.finish_reason is not None:
                    finished = True
                    track.finished(event.finish_reason.value)
                yield event
        except LoraplexError:
            finished = True  # the engine refused the request: there is nothing to abort
            refused = not track.admitted
            raise
        except (GeneratorExit, asyncio.CancelledError):
            if not finished:  # the caller left, or its deadline passed: an abort, as vLLM counts it
                track.finished(FinishReason.ABORT.value)
            raise
        finally:
            metrics.active_streams.dec()
            if not refused and track.admit():  # aborted while it waited: it was taken all the same
                tenancy.admitted(ticket, prompt)
            if not finished:  # cancelled, deadline passed, or failed mid-stream
                engine.abort(req.request_id)
            await stream.aclose()


async def interleaved(streams: Sequence[AsyncIterator[TokenEvent]], firsts: Sequence[TokenEvent] | None = None
                      ) -> AsyncIterator[tuple[int, TokenEvent]]:
    """The events of several generations of one call (the ``n`` choices of a prompt) as they
    come, each with its stream's index; ``firsts``: each stream's first event, already taken
    (an edge that waited for them before answering). The first error of any stream is raised
    (after the events before it). Closing this closes every stream, aborting what still runs."""
    if firsts is not None:
        for i, first in enumerate(firsts):
            yield i, first
    if len(streams) == 1:
        async with aclosing(streams[0]):  # type: ignore[type-var]
            async for event in streams[0]:
                yield 0, event
        return
    queue: asyncio.Queue[tuple[int, TokenEvent | BaseException | None]] = asyncio.Queue()

    async def pump(i: int) -> None:
        try:
            async for event in streams[i]:
                await queue.put((i, event))
        except Exception as exc:  # noqa: BLE001  (handed to the reader, which raises it)
            await queue.put((i, exc))
        await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i)) for i in range(len(streams))]
    try:
        open_streams = len(streams)
        while open_streams:
            i, item = await queue.get()
            if item is None:
                open_streams -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()  # type: ignore[attr-defined]
