"""In-memory blob cache, bounded by total bytes, evicting the least recently used blob first."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterator


class MemoryBlobCache:
    """An LRU of blobs whose sizes sum to at most ``capacity`` bytes."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"cache capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._blobs: OrderedDict[str, bytes] = OrderedDict()
        self._total = 0
        self._lock = threading.Lock()

    @property
    def total_bytes(self) -> int:
        with self._lock:
            return self._total

    def keys(self) -> list[str]:
        """Cached keys, least recently used first."""
        with self._lock:
            return list(self._blobs)

    def get(self, key: str) -> bytes | None:
        with self._lock:
            data = self._blobs.get(key)
            if data is not None:
                self._blobs.move_to_end(key)
            return data

    def pieces(self, key: str) -> Iterator[bytes] | None:
        data = self.get(key)
        return None if data is None else iter((data,))

    def put(self, key: str, data: bytes) -> bool:
        if len(data) > self.capacity:
            return False
        with self._lock:
            old = self._blobs.pop(key, None)
            self._total -= len(old) if old is not None else 0
            self._blobs[key] = data
            self._total += len(data)
            while self._total > self.capacity:
                _, victim = self._blobs.popitem(last=False)
                self._total -= len(victim)
            return True

    def discard(self, key: str) -> None:
        with self._lock:
            old = self._blobs.pop(key, None)
            self._total -= len(old) if old is not None else 0
