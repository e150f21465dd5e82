"""Waiting for a request's events while watching its connection: a client that hangs up
before its first token, or before its whole answer, has its generations closed at once, which
aborts them in the engine (a request still queued, or waiting for its adapter, holds no slot
and is prefilled for nobody)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from typing import TypeVar

from starlette.requests import Request

from loraplex.adapter_store.errors import ClientDisconnectedError
from loraplex.inference_server.engine.request import TokenEvent

T = TypeVar("T")


async def _first(events: AsyncIterator[TokenEvent]) -> TokenEvent:
    """The stream's first event (refusals raise here, before any header is sent)."""
    try:
        return await anext(events)
    except BaseException:
        await events.aclose()  # type: ignore[attr-defined]
        raise


async def firsts(streams: list[AsyncIterator[TokenEvent]]) -> list[TokenEvent]:
    """Every stream's first event; the first refusal is raised, with every stream closed."""
    results = await asyncio.gather(*(_first(s) for s in streams), return_exceptions=True)
    failed = next((r for r in results if isinstance(r, BaseException)), None)
    if failed is not None:
        await close_all(streams)
        raise failed
    return list(results)  # type: ignore[arg-type]


async def close_all(streams: list[AsyncIterator[TokenEvent]]) -> None:
    """Close every stream (a generation not finished is aborted in the engine)."""
    for stream in streams:
        await stream.aclose()  # type: ignore[attr-defined]


async def collect(events: AsyncIterator[tuple[int, TokenEvent]], n: int) -> list[list[TokenEvent]]:
    """Each choice's events, in order."""
    out: list[list[TokenEvent]] = [[] for _ in range(n)]
    async with aclosing(events):  # type: ignore[type-var]
        async for index, event in events:
            out[index].append(event)
    return out


async def _disconnected(request: Request) -> None:
    """Return when the client closes the connection (the body has been read by then)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T], streams: list[AsyncIterator[TokenEvent]],
                              waiting_for: str) -> T:
    """``work``'s result; if the client disconnects first, ``work`` is cancelled, ``streams`` are
    closed (aborting their requests in the engine at once) and ClientDisconnectedError (499)
    names what the client left before (``waiting_for``)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
        await asyncio.gather(task, gone, return_exceptions=True)
    if task.cancelled():
        await close_all(streams)  # also if the work never started
        raise ClientDisconnectedError(f"the client disconnected before {waiting_for}; its request was aborted")
    return task.result()
