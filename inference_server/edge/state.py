"""What the edge knows about its own lifecycle: engine loaded?, admitting?, which work is open.

New work is refused with UNAVAILABLE while the model loads and once shutdown has begun
(draining); open Generate streams and uploads are tracked so shutdown can wait for them,
and abort the streams that outlive the grace period.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from loraplex.adapter_store.errors import ResourceExhaustedError, UnavailableError
from loraplex.inference_server.engine.api import ServingEngine


class ServingState:
    """Engine handle + admission control + the set of open requests."""

    def __init__(self, max_concurrent_streams: int) -> None:
        if max_concurrent_streams < 1:
            raise ValueError(f"max_concurrent_streams must be >= 1, got {max_concurrent_streams}")
        self._max_streams = max_concurrent_streams
        self._engine: ServingEngine | None = None
        self._draining = False
        self._streams: set[str] = set()
        self._other = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def engine(self) -> ServingEngine | None:
        return self._engine

    @property
    def draining(self) -> bool:
        return self._draining

    def set_engine(self, engine: ServingEngine) -> None:
        """The model is loaded: start serving requests."""
        self._engine = engine

    def engine_or_raise(self) -> ServingEngine:
        """The engine, or UNAVAILABLE while the model loads or the server shuts down."""
        if self._draining:
            raise UnavailableError("the server is shutting down; retry on another replica")
        if self._engine is None:
            raise UnavailableError("the model is still loading; retry shortly")
        return self._engine

    @asynccontextmanager
    async def stream(self, request_id: str) -> AsyncIterator[None]:
        """Admit one Generate stream for its lifetime (RESOURCE_EXHAUSTED when too many are open)."""
        self.engine_or_raise()
        if len(self._streams) >= self._max_streams:
            raise ResourceExhaustedError(
                f"too many concurrent streams (limit {self._max_streams}); retry later"
            )
        self._streams.add(request_id)
        self._idle.clear()
        try:
            yield
        finally:
            self._streams.discard(request_id)
            self._maybe_idle()

    @asynccontextmanager
    async def work(self) -> AsyncIterator[ServingEngine]:
        """Admit one non-streaming mutation (upload, delete) for its lifetime; yields the engine."""
        engine = self.engine_or_raise()
        self._other += 1
        self._idle.clear()
        try:
            yield engine
        finally:
            self._other -= 1
            self._maybe_idle()

    def _maybe_idle(self) -> None:
        if not self._streams and self._other == 0:
            self._idle.set()

    def start_draining(self) -> None:
        """Refuse new work from now on."""
        self._draining = True

    def open_stream_ids(self) -> list[str]:
        """Engine request ids of the Generate streams still open."""
        return sorted(self._streams)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no work is open; False if ``timeout`` seconds pass first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True
