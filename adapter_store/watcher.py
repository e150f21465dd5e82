"""Keep an adapter cache (the inference server's adapter pool) in step with the store.

``StoreWatcher`` follows the store's change events and calls ``invalidate(adapter_id)``
for every held adapter that was replaced or deleted. On a resync (at the start, after
Redis or the store came back) it re-checks every held adapter's version with Stat, so
a missed event never leaves a stale copy in use.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Protocol, runtime_checkable

from loraplex.adapter_store.errors import AdapterNotFoundError, LoraplexError
from loraplex.adapter_store.format.files import ChangeFollowedSource
from loraplex.adapter_store.records import KIND_DELETE, KIND_PUT, KIND_RESYNC, ChangeEvent

log = logging.getLogger(__name__)


@runtime_checkable
class PushedChanges(Protocol):
    """An in-process Store: it calls back with each change (a resync first) until unsubscribed."""

    def subscribe(self, callback: Callable[[ChangeEvent], None]) -> Callable[[], None]: ...


class StoreWatcher:
    """Calls ``invalidate(id)`` when a held adapter changes. ``held()`` returns {id: version}
    of what the caller holds; ``source`` is a StoreClient (gRPC, followed from a thread) or an
    in-process Store (which pushes its changes)."""

    def __init__(
        self,
        source: ChangeFollowedSource | PushedChanges,
        held: Callable[[], Mapping[str, str]],
        invalidate: Callable[[str], None],
        retry_s: float = 1.0,
    ) -> None:
        self._source = source
        self._held = held
        self._invalidate = invalidate
        self._retry_s = retry_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._unsubscribe: Callable[[], None] | None = None
        self._watch = None
        self.resyncs = 0

    def start(self) -> "StoreWatcher":
        if isinstance(self._source, PushedChanges):
            self._unsubscribe = self._source.subscribe(self.handle)
        else:
            self._thread = threading.Thread(target=self._follow, name="store-watcher", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._unsubscribe is not None:
            self._unsubscribe()
        if self._watch is not None:
            self._watch.cancel()
        if self._thread is not None:
            self._thread.join(5)

    def _follow(self) -> None:
        """Follow the store's feed, reconnecting every ``retry_s``. An outage is logged once when
        it starts (and again if its reason changes) and once when the feed is back, not once a
        retry."""
        failing: str | None = None  # the reason of the outage going on, if any
        while not self._stop.is_set():
            try:
                self._watch = self._source.watch()
                for event in self._watch:
                    if failing is not None:
                        log.info("store watch resumed (it failed with: %s)", failing)
                        failing = None
                    self.handle(event)
            except LoraplexError as e:
                if str(e) != failing:
                    log.warning("store watch interrupted (%s); retrying every %.1fs, logged again when it resumes",
                                e, self._retry_s)
                failing = str(e)
            self._stop.wait(self._retry_s)

    def handle(self, event: ChangeEvent) -> None:
        """Apply one change event (public so callers with their own event loop can feed it)."""
        held = self._held()
        if event.kind == KIND_RESYNC:
            self._recheck(held)
            self.resyncs += 1  # counted once done, so a caller waiting for it sees the re-check's effects
        elif event.kind == KIND_DELETE and event.adapter_id in held:
            self._invalidate(event.adapter_id)
        elif event.kind == KIND_PUT and event.adapter_id in held and held[event.adapter_id] != event.version:
            self._invalidate(event.adapter_id)

    def _recheck(self, held: Mapping[str, str]) -> None:
        for adapter_id, version in held.items():
            try:
                current = self._stat_version(adapter_id)
            except AdapterNotFoundError:
                current = None
            except LoraplexError as e:
                log.warning("cannot re-check %s (%s); keeping it until the next resync", adapter_id, e)
                continue
            if current != version:
                self._invalidate(adapter_id)

    def _stat_version(self, adapter_id: str) -> str:
        return self._source.stat(adapter_id).version
