"""In-process change feed: events reach the subscribers of this process only."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from loraplex.adapter_store.records import KIND_RESYNC, ChangeEvent

log = logging.getLogger(__name__)


class Subscribers:
    """A thread-safe set of callbacks; a failing callback is logged and does not stop the rest."""

    def __init__(self) -> None:
        self._callbacks: dict[int, Callable[[ChangeEvent], None]] = {}
        self._next = 0
        self._lock = threading.Lock()

    def add(self, callback: Callable[[ChangeEvent], None]) -> Callable[[], None]:
        with self._lock:
            token = self._next
            self._next += 1
            self._callbacks[token] = callback

        def unsubscribe() -> None:
            with self._lock:
                self._callbacks.pop(token, None)

        return unsubscribe

    def deliver(self, event: ChangeEvent) -> None:
        with self._lock:
            callbacks = list(self._callbacks.values())
        for callback in callbacks:
            try:
                callback(event)
            except Exception:  # noqa: BLE001  (one bad subscriber must not starve the others)
                log.exception("change subscriber failed on %s", event)


class MemoryChangeFeed:
    """Delivers each published event synchronously to this process's subscribers."""

    def __init__(self) -> None:
        self._subscribers = Subscribers()

    def publish(self, event: ChangeEvent) -> bool:
        self._subscribers.deliver(event)
        return True

    def subscribe(self, callback: Callable[[ChangeEvent], None]) -> Callable[[], None]:
        unsubscribe = self._subscribers.add(callback)
        callback(ChangeEvent(KIND_RESYNC))
        return unsubscribe

    def close(self) -> None:
        pass
