"""Redis connection and error translation shared by the Redis index, cache and feed."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from loraplex.adapter_store.errors import BackendUnavailable
from loraplex.adapter_store.settings import RedisSettings

# Redis cannot serve now: connection-level failures, and a server out of memory (maxmemory under
# the noeviction policy) or a read-only replica. A script or type error is a bug and must
# surface as one.
REDIS_DOWN = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError,
              redis.exceptions.OutOfMemoryError, redis.exceptions.ReadOnlyError)


def connect(settings: RedisSettings) -> redis.Redis:
    """A client that fails fast when Redis is gone (one quick retry), so reads can fall back."""
    return redis.Redis.from_url(
        settings.url,
        socket_timeout=settings.socket_timeout_s,
        socket_connect_timeout=min(settings.socket_timeout_s, 1.0),
        retry=Retry(ExponentialBackoff(cap=0.05, base=0.01), 1),
        health_check_interval=10,
        socket_read_size=1 << 20,  # cached blobs are tens of MB: fewer, larger reads
    )


def describe(client: redis.Redis) -> str:
    kw = client.connection_pool.connection_kwargs
    where = kw.get("path") or f"{kw.get('host')}:{kw.get('port')}"
    return f"Redis at {where}"


# Failures that say Redis did not answer (not that it answered no, as out of memory does).
_NO_ANSWER = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


class Breaker:
    """After a Redis call got no answer (timed out, could not connect), the calls of the next
    ``cool_down_s`` fail at once instead of each waiting out the socket timeout: a hung Redis
    (accepting connections, never answering) cost every store call 10 s a Redis command, 30-80 s
    an operation, past the clients' deadlines. One breaker per Redis client, shared by its users."""

    def __init__(self, cool_down_s: float = 5.0, clock=time.monotonic) -> None:
        self.cool_down_s = cool_down_s
        self._clock = clock
        self._open_until = 0.0
        self._lock = threading.Lock()

    def check(self, description: str) -> None:
        with self._lock:
            left = self._open_until - self._clock()
        if left > 0:
            raise BackendUnavailable(description, f"not tried: it did not answer {self.cool_down_s - left:.1f}s ago")

    def trip(self) -> None:
        with self._lock:
            self._open_until = self._clock() + self.cool_down_s


@contextmanager
def translated(description: str, breaker: Breaker | None = None) -> Iterator[None]:
    """Turn Redis connection errors into BackendUnavailable; with a ``breaker``, skip Redis while
    it is open and open it when Redis does not answer."""
    if breaker is not None:
        breaker.check(description)
    try:
        yield
    except REDIS_DOWN as e:
        if breaker is not None and isinstance(e, _NO_ANSWER):
            breaker.trip()
        raise BackendUnavailable(description, f"{type(e).__name__}: {e}") from e
