"""Redis blob cache, bounded by total bytes, evicting the least recently used blob first.

Keys: ``ns:blob:<key>`` (the bytes), ``ns:lru`` (sorted set: blob key -> last use, in
Redis server time, so every store process agrees), ``ns:bytes`` (total cached bytes).
Every change is one Lua script, so the accounting stays right with many store processes.
(Standalone Redis: the scripts touch keys they discover, which Redis Cluster forbids.)
"""

from __future__ import annotations

import redis

from adapter_store.backends.redis_conn import describe, translated

_NOW = "local t = redis.call('TIME') local now = tonumber(t[1]) * 1000000 + tonumber(t[2])\n"

# KEYS: blob, lru, total. ARGV: data, capacity. Returns 1 if cached.
_PUT = _NOW + """
local size = string.len(ARGV[1])
local cap = tonumber(ARGV[2])
if size > cap then return 0 end
local old = redis.call('STRLEN', KEYS[1])
redis.call('SET', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], now, KEYS[1])
local total = redis.call('INCRBY', KEYS[3], size - old)
while total > cap do
  local victim = redis.call('ZRANGE', KEYS[2], 0, 0)[1]
  if not victim then break end
  total = redis.call('DECRBY', KEYS[3], redis.call('STRLEN', victim))
  redis.call('DEL', victim)
  redis.call('ZREM', KEYS[2], victim)
end
return 1
"""

# KEYS: blob, lru. Returns the bytes (and marks them used) or nil.
_GET = _NOW + """
local data = redis.call('GET', KEYS[1])
if data then redis.call('ZADD', KEYS[2], 'XX', now, KEYS[1]) end
return data
"""

# KEYS: blob, lru, total.
_DISCARD = """
local size = redis.call('STRLEN', KEYS[1])
if size > 0 then
  redis.call('DEL', KEYS[1])
  redis.call('DECRBY', KEYS[3], size)
end
redis.call('ZREM', KEYS[2], KEYS[1])
return size
"""


class RedisBlobCache:
    """An LRU of blobs in Redis whose sizes sum to at most ``capacity`` bytes."""

    def __init__(self, client: redis.Redis, namespace: str, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"cache capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._r = client
        self._ns = namespace
        self._lru = f"{namespace}:lru"
        self._total = f"{namespace}:bytes"
        self.description = describe(client)
        self._put = client.register_script(_PUT)
        self._get = client.register_script(_GET)
        self._discard = client.register_script(_DISCARD)

    def _blob(self, key: str) -> str:
        return f"{self._ns}:blob:{key}"

    @property
    def total_bytes(self) -> int:
        with translated(self.description):
            return int(self._r.get(self._total) or 0)

    def keys(self) -> list[str]:
        """Cached keys, least recently used first."""
        cut = len(self._blob(""))
        with translated(self.description):
            return [k.decode()[cut:] for k in self._r.zrange(self._lru, 0, -1)]

    def get(self, key: str) -> bytes | None:
        with translated(self.description):
            return self._get(keys=[self._blob(key), self._lru])

    def put(self, key: str, data: bytes) -> bool:
        if len(data) > self.capacity:
            return False
        with translated(self.description):
            return bool(self._put(keys=[self._blob(key), self._lru, self._total], args=[data, self.capacity]))

    def discard(self, key: str) -> None:
        with translated(self.description):
            self._discard(keys=[self._blob(key), self._lru, self._total])
