"""One request's token events on their way from the step thread to the edge that streams them.

The step loop hands each step's events to the event loop, which puts them here; the edge's
reader takes them out and sends one message each. A reader that falls behind (an event loop
busy with many streams, a slow client) would otherwise send one message per step however far
behind it is, and each message costs the edge the same whatever it carries. So ``get`` returns
every event waiting at once, merged into one: the same tokens, text, log-probabilities (the
prompt's too) and finish, in fewer messages, and a backlog is caught up in one send (vLLM's output collector does
the same). A reader that keeps up sees one event per step, as before.

An ERROR event is never merged with the tokens before it: the edges report it as a failure
without its text, so the tokens ahead of it go out first, on their own. A merged event holds
at most MAX_MERGED_TOKENS tokens, so a message stays far below a gRPC client's default 4 MB
receive limit (with 20 top log-probabilities a token takes ~240 bytes on the wire).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence

from loraplex.inference_server.engine.request import FinishReason, TokenEvent

MAX_MERGED_TOKENS = 1024


class TokenStream:
    """A request's pending events (event-loop side only: ``put`` from the loop's callbacks,
    ``get`` from one reader)."""

    __slots__ = ("_pending", "_arrived")

    def __init__(self) -> None:
        self._pending: deque[TokenEvent] = deque()
        self._arrived = asyncio.Event()

    def put(self, event: TokenEvent) -> None:
        self._pending.append(event)
        self._arrived.set()

    async def get(self) -> TokenEvent:
        """The next event: every event waiting, merged (see the module docstring)."""
        while not self._pending:
            self._arrived.clear()
            await self._arrived.wait()
        return merge_events(self._take())

    def _take(self) -> list[TokenEvent]:
        taken = [self._pending.popleft()]
        tokens = len(taken[0].token_ids)
        while self._pending and _joins(taken[-1], self._pending[0], tokens):
            taken.append(self._pending.popleft())
            tokens += len(taken[-1].token_ids)
        return taken


def _joins(last: TokenEvent, following: TokenEvent, tokens: int) -> bool:
    """Whether ``following`` may be merged after ``last``, ``tokens`` tokens taken so far
    (nothing follows a finish; an error stays on its own; the size is bounded)."""
    return (last.finish_reason is None and following.finish_reason is not FinishReason.ERROR
            and tokens + len(following.token_ids) <= MAX_MERGED_TOKENS)


def merge_events(events: Sequence[TokenEvent]) -> TokenEvent:
    """Consecutive events of one request as one: tokens, text and log-probabilities in order,
    the prompt's log-probabilities of the event that carried them (a request's first token
    event), the finish reason, usage and timings of the last (only the last may finish)."""
    if len(events) == 1:
        return events[0]
    last = events[-1]
    prompt = next((e for e in events if e.prompt_logprobs is not None), last)
    return TokenEvent(
        request_id=last.request_id,
        token_ids=tuple(t for e in events for t in e.token_ids),
        text="".join(e.text for e in events),
        logprobs=_joined([e.logprobs for e in events]),
        top_logprobs=_joined([e.top_logprobs for e in events]),
        prompt_logprobs=prompt.prompt_logprobs,
        prompt_top_logprobs=prompt.prompt_top_logprobs,
        finish_reason=last.finish_reason,
        usage=last.usage,
        timings=last.timings,
    )


def _joined(parts: list[tuple | None]) -> tuple | None:
    """The parts in order; None when no event carried any (a request that asked for none)."""
    if all(p is None for p in parts):
        return None
    return tuple(x for p in parts if p is not None for x in p)
