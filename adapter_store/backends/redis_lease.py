"""A writer's lease on one adapter id in Redis: short, renewed while held, checked at commit.

The lease key lives ``lease_s`` seconds and a thread renews it every third of that while its
holder runs, so a sidecar killed mid-upload frees the id within ``lease_s`` (not after a long
fixed lock timeout). Before its commit point the holder confirms the lease is still its own
(``check``): a holder whose lease ran out (Redis unreachable from it, the process paused) and
was taken over by another writer does not commit over that writer's acknowledged upload.
"""

from __future__ import annotations

import logging
import threading
import time

import redis

from loraplex.adapter_store.backends.redis_conn import REDIS_DOWN
from loraplex.adapter_store.errors import LeaseLost

log = logging.getLogger(__name__)


class RedisLease:
    """One held lease; ``release()`` when done. Renewal runs in a daemon thread."""

    exclusive = True

    def __init__(self, lock: redis.lock.Lock, adapter_id: str, lease_s: float) -> None:
        self._lock = lock
        self._id = adapter_id
        self._lease_s = lease_s
        self._renewed_at = time.monotonic()
        self._lost = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._renew_forever, name=f"lease {adapter_id}", daemon=True)
        self._thread.start()

    def _renew_forever(self) -> None:
        while not self._stop.wait(self._lease_s / 3):
            try:
                self._lock.reacquire()  # TTL back to lease_s, only if the token is still ours
                self._renewed_at = time.monotonic()
            except redis.exceptions.LockNotOwnedError:
                log.warning("writer lease on %s was lost (taken over by another writer)", self._id)
                self._lost.set()
                return
            except REDIS_DOWN as e:
                log.warning("writer lease on %s not renewed: %s", self._id, e)

    def check(self) -> None:
        """Raise LeaseLost unless the lease is still ours (asked of Redis now). If Redis does not
        answer, the lease counts as ours only while its last renewal has not run out."""
        if self._lost.is_set():
            raise LeaseLost(self._id, "another writer took it over")
        try:
            self._lock.reacquire()
            self._renewed_at = time.monotonic()
        except redis.exceptions.LockNotOwnedError:
            self._lost.set()
            raise LeaseLost(self._id, "another writer took it over") from None
        except REDIS_DOWN as e:
            if time.monotonic() - self._renewed_at >= self._lease_s:
                raise LeaseLost(self._id, f"not renewed for {self._lease_s}s ({e})") from None

    def release(self) -> None:
        self._stop.set()
        self._thread.join(self._lease_s)
        try:
            self._lock.release()
        except (redis.exceptions.LockError, *REDIS_DOWN):
            pass  # expired or taken over, or Redis went away: nothing of ours is left to free


def acquire_lease(client: redis.Redis, key: str, adapter_id: str, lease_s: float, wait_s: float) -> RedisLease | None:
    """The lease on ``key``, waiting at most ``wait_s``; None if another writer holds it that long.
    Redis errors pass through (the caller translates them)."""
    lock = client.lock(key, timeout=lease_s, sleep=0.05, blocking=True, blocking_timeout=max(wait_s, 0.0),
                       thread_local=False)  # the renewal thread uses the holder's token
    if not lock.acquire():
        return None
    return RedisLease(lock, adapter_id, lease_s)
