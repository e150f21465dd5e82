"""In-process writer locks, one per adapter id (not striped: unrelated ids never wait on each
other), created on demand and dropped when no thread holds or waits for them."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager


class IdLocks:
    """``hold(adapter_id, wait_s)``: exclusive per id within this process, waiting at most ``wait_s``."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[str, tuple[threading.Lock, int]] = {}  # id -> (lock, holders + waiters)

    @contextmanager
    def hold(self, adapter_id: str, wait_s: float) -> Iterator[bool]:
        """Yields True when the lock is held, False when ``wait_s`` passed first."""
        lock = self._enter(adapter_id)
        try:
            acquired = lock.acquire(timeout=max(0.0, wait_s))
            try:
                yield acquired
            finally:
                if acquired:
                    lock.release()
        finally:
            self._leave(adapter_id)

    def _enter(self, adapter_id: str) -> threading.Lock:
        with self._guard:
            lock, users = self._locks.get(adapter_id, (None, 0))
            lock = lock or threading.Lock()
            self._locks[adapter_id] = (lock, users + 1)
            return lock

    def _leave(self, adapter_id: str) -> None:
        with self._guard:
            lock, users = self._locks[adapter_id]
            if users == 1:
                del self._locks[adapter_id]
            else:
                self._locks[adapter_id] = (lock, users - 1)

    def __len__(self) -> int:
        with self._guard:
            return len(self._locks)
