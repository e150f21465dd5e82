"""Counters and a load-latency histogram for the adapter pool (read by the metrics edge)."""

from __future__ import annotations

import threading
from dataclasses import dataclass

# Upper bounds (seconds) of the load-latency histogram buckets, then +Inf.
LOAD_BUCKETS = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)
COUNTERS = ("gpu_hits", "gpu_joins", "gpu_loads", "host_hits", "source_fetches", "gpu_evictions", "host_evictions",
            "invalidations", "stale_fetches")  # stale: read before an invalidation, so fetched again


class PoolMetrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._buckets = [0] * (len(LOAD_BUCKETS) + 1)
        self._load_sum = 0.0

    def count(self, name: str) -> None:
        with self._lock:
            self._counts[name] += 1

    def observe_load(self, seconds: float) -> None:
        with self._lock:
            index = next((i for i, b in enumerate(LOAD_BUCKETS) if seconds <= b), len(LOAD_BUCKETS))
            self._buckets[index] += 1
            self._load_sum += seconds

    def snapshot(self) -> dict[str, float]:
        with self._lock:
            out: dict[str, float] = dict(self._counts)
            out["load_seconds_sum"] = self._load_sum
            out["load_count"] = sum(self._buckets)
            for bound, n in zip((*LOAD_BUCKETS, float("inf")), self._buckets):
                out[f"load_le_{bound}"] = n
            return out


@dataclass(frozen=True, slots=True)
class PoolStats:
    resident: int
    in_use: int
    waiting: int
    used_bytes: int
    capacity_bytes: int
    host_entries: int
    host_bytes: int
    counters: dict[str, float]

    @property
    def evictions(self) -> int:
        return int(self.counters["gpu_evictions"])

    @property
    def loads(self) -> int:
        return int(self.counters["load_count"])
