"""Redis blob cache, bounded by total bytes, evicting the least recently used blob first.

Keys: ``ns:blob:<key>`` (the bytes), ``ns:lru`` (sorted set: blob key -> last use, in
Redis server time, so every store process agrees), ``ns:sizes`` (hash: blob key -> bytes),
``ns:bytes`` (total cached bytes).
The bytes move with plain SET and GET / GETRANGE (a Lua script copying 80 MB would double
the time); a large blob is read as ranges over several connections at once (``pieces``):
one 80 MB reply parses at ~0.8 GB/s in one thread, and socket reads drop the GIL.
the accounting is a Lua script run in the same MULTI as the SET, so it stays right with
many store processes.
(Standalone Redis: the scripts touch keys they discover, which Redis Cluster forbids.)
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor

import redis

from loraplex.adapter_store.backends.redis_conn import Breaker, describe, translated

_NOW = "local t = redis.call('TIME') local now = tonumber(t[1]) * 1000000 + tonumber(t[2])\n"

# Run after SET of KEYS[1] in the same MULTI. KEYS: blob, lru, total, sizes. ARGV: size, capacity.
_ACCOUNT = _NOW + """
local size = tonumber(ARGV[1])
local cap = tonumber(ARGV[2])
local old = tonumber(redis.call('HGET', KEYS[4], KEYS[1]) or '0')
redis.call('HSET', KEYS[4], KEYS[1], size)
redis.call('ZADD', KEYS[2], now, KEYS[1])
local total = redis.call('INCRBY', KEYS[3], size - old)
while total > cap do
  local victim = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if not victim then break end
  total = redis.call('DECRBY', KEYS[3], tonumber(redis.call('HGET', KEYS[4], victim) or '0'))
  redis.call('DEL', victim)
  redis.call('ZREM', KEYS[2], victim)
  redis.call('HDEL', KEYS[4], victim)
end
return 1
"""

# KEYS: blob, lru. Marks the blob recently used if it is cached.
_TOUCH = _NOW + """
if redis.call('EXISTS', KEYS[1]) == 1 then redis.call('ZADD', KEYS[2], 'XX', now, KEYS[1]) end
return 1
"""

# KEYS: blob, lru, total, sizes.
_DISCARD = """
local size = tonumber(redis.call('HGET', KEYS[4], KEYS[1]) or '0')
redis.call('DECRBY', KEYS[3], size)
redis.call('HDEL', KEYS[4], KEYS[1])
redis.call('ZREM', KEYS[2], KEYS[1])
redis.call('DEL', KEYS[1])
return size
"""


RANGE_BYTES = 4 << 20  # one GETRANGE of ``pieces``
READ_THREADS = 4  # GETRANGEs in flight at once (connections of the client's pool)


class RedisBlobCache:
    """An LRU of blobs in Redis whose sizes sum to at most ``capacity`` bytes."""

    def __init__(self, client: redis.Redis, namespace: str, capacity: int, breaker: Breaker | None = None) -> None:
        self._breaker = breaker or Breaker()
        if capacity < 0:
            raise ValueError(f"cache capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._r = client
        self._ns = namespace
        self._lru = f"{namespace}:lru"
        self._total = f"{namespace}:bytes"
        self._sizes = f"{namespace}:sizes"
        self.description = describe(client)
        self._account = client.register_script(_ACCOUNT)
        self._touch = client.register_script(_TOUCH)
        self._discard = client.register_script(_DISCARD)
        self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="redis-blob-read")

    def _blob(self, key: str) -> str:
        return f"{self._ns}:blob:{key}"

    @property
    def total_bytes(self) -> int:
        with translated(self.description, self._breaker):
            return int(self._r.get(self._total) or 0)

    def keys(self) -> list[str]:
        """Cached keys, least recently used first."""
        cut = len(self._blob(""))
        with translated(self.description, self._breaker):
            return [k.decode()[cut:] for k in self._r.zrange(self._lru, 0, -1)]

    def get(self, key: str) -> bytes | None:
        pieces = self.pieces(key)
        if pieces is None:
            return None
        with translated(self.description, self._breaker):
            return b"".join(pieces)

    def pieces(self, key: str) -> Iterator[bytes] | None:
        blob = self._blob(key)
        with translated(self.description, self._breaker):
            pipe = self._r.pipeline(transaction=False)
            pipe.exists(blob)
            pipe.strlen(blob)
            pipe.getrange(blob, 0, RANGE_BYTES - 1)
            self._touch(keys=[blob, self._lru], client=pipe)
            exists, size, first, _ = pipe.execute()
        if not exists:
            return None
        rest = [self._readers.submit(self._r.getrange, blob, start, min(size, start + RANGE_BYTES) - 1)
                for start in range(RANGE_BYTES, size, RANGE_BYTES)]
        return self._in_order(first, rest)

    def _in_order(self, first: bytes, rest: list[Future]) -> Iterator[bytes]:
        try:
            yield first
            for future in rest:
                with translated(self.description, self._breaker):
                    yield future.result()
        finally:  # the consumer stopped early (e.g. a bad checksum): do not read the rest
            for future in rest:
                future.cancel()

    def put(self, key: str, data: bytes) -> bool:
        if len(data) > self.capacity:
            return False
        with translated(self.description, self._breaker):
            pipe = self._r.pipeline(transaction=True)
            pipe.set(self._blob(key), data)
            self._account(keys=[self._blob(key), self._lru, self._total, self._sizes],
                         args=[len(data), self.capacity], client=pipe)
            pipe.execute()
        return True

    def discard(self, key: str) -> None:
        with translated(self.description, self._breaker):
            self._discard(keys=[self._blob(key), self._lru, self._total, self._sizes])
