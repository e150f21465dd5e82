"""Redis connection and error translation shared by the Redis index, cache and feed."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from adapter_store.errors import BackendUnavailable
from adapter_store.settings import RedisSettings

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


@contextmanager
def translated(description: str) -> Iterator[None]:
    """Turn Redis connection errors into BackendUnavailable."""
    try:
        yield
    except REDIS_DOWN as e:
        raise BackendUnavailable(description, f"{type(e).__name__}: {e}") from e
