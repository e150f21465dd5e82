"""Bookkeeping of fallbacks: count each one, log when a dependency goes down or comes back."""

from __future__ import annotations

import logging
import threading

from loraplex.adapter_store.metrics import StoreMetrics

log = logging.getLogger(__name__)


class Degradation:
    """Which optional dependencies (index, cache, feed) are currently failing."""

    def __init__(self, metrics: StoreMetrics) -> None:
        self._metrics = metrics
        self._down: set[str] = set()
        self._lock = threading.Lock()

    def fell_back(self, dependency: str, error: Exception) -> None:
        """An operation went on without ``dependency``; logs the first failure of a streak."""
        self._metrics.degraded.labels(dependency).inc()
        with self._lock:
            first = dependency not in self._down
            self._down.add(dependency)
        if first:
            log.warning("store degraded: %s failed (%s); serving without it", dependency, error)

    def ok(self, dependency: str) -> None:
        with self._lock:
            was_down = dependency in self._down
            self._down.discard(dependency)
        if was_down:
            log.info("store: %s is back", dependency)

    def is_down(self, dependency: str) -> bool:
        with self._lock:
            return dependency in self._down
