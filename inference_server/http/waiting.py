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
    """Every stream's first event; the first refusal is raised as it comes, with every stream
    closed. (Not after every other stream's first event: a choice refused at once (429) was held
    until the admitted ones had their first token, behind the whole queue, holding its place.)"""
    tasks = [asyncio.ensure_future(_first(s)) for s in streams]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:  # a refusal, or this wait cancelled (the client left): stop the others, then close
        pending = [t for t in tasks if not t.done()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    errors = [t.exception() for t in tasks if not t.cancelled()]  # each one read, or asyncio logs it as lost
    failed = next((e for e in errors if e is not None), None)
    if failed is not None or any(t.cancelled() for t in tasks):
        await close_all(streams)
        raise failed if failed is not None else asyncio.CancelledError()
    return [t.result() for t in tasks]


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
