"""Redis index: one JSON record per adapter id and a sorted set of ids for paged listing.

Keys (``ns`` = the namespace): ``ns:rec:<id>`` (record JSON), ``ns:ids`` (sorted set, all
scores 0, so ZRANGEBYLEX pages in byte order), ``ns:complete`` (set by a full rebuild;
gone after a Redis restart, which triggers the next rebuild), ``ns:lock:<id>`` (a writer's lease:
redis_lease.py), ``ns:blob-marker`` (the blob backend's marker: blob_marker.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import redis

from loraplex.adapter_store.backends.redis_conn import Breaker, describe, translated
from loraplex.adapter_store.backends.redis_lease import RedisLease, acquire_lease
from loraplex.adapter_store.errors import UnavailableError
from loraplex.adapter_store.records import StoredRecord

# Write a record read from the blob backend unless the stored one is newer than ARGV[3]
# (the record's own time, or the start of a scan).
_UPSERT_IF_NEWER = """
local cur = redis.call('GET', KEYS[1])
if cur and cjson.decode(cur)['created_at'] > tonumber(ARGV[3]) then return 0 end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('ZADD', KEYS[2], 0, ARGV[1])
return 1
"""
# Remove an id the scan did not see, unless it was written after the scan started.
_REMOVE_IF_OLDER = """
local cur = redis.call('GET', KEYS[1])
if cur and cjson.decode(cur)['created_at'] >= tonumber(ARGV[2]) then return 0 end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
"""


class RedisIndex:
    """Adapter records in Redis, shared by every store process using the same namespace."""

    def __init__(self, client: redis.Redis, namespace: str, lease_s: float = 5.0,
                 breaker: Breaker | None = None) -> None:
        if not lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self._breaker = breaker or Breaker()
        self._r = client
        self._ns = namespace
        self._lease_s = lease_s  # how soon a dead writer's id is free again
        self._ids = f"{namespace}:ids"
        self._complete = f"{namespace}:complete"
        self._marker = f"{namespace}:blob-marker"
        self.description = describe(client)
        self._upsert = client.register_script(_UPSERT_IF_NEWER)
        self._remove_older = client.register_script(_REMOVE_IF_OLDER)

    def _rec(self, adapter_id: str) -> str:
        return f"{self._ns}:rec:{adapter_id}"

    def get(self, adapter_id: str) -> StoredRecord | None:
        with translated(self.description, self._breaker):
            raw = self._r.get(self._rec(adapter_id))
        return StoredRecord.from_json(raw) if raw is not None else None

    def put(self, record: StoredRecord) -> None:
        with translated(self.description, self._breaker):
            pipe = self._r.pipeline(transaction=True)
            pipe.set(self._rec(record.adapter_id), record.to_json())
            pipe.zadd(self._ids, {record.adapter_id: 0})
            pipe.execute()

    def fill(self, record: StoredRecord) -> None:
        with translated(self.description, self._breaker):
            self._upsert(
                keys=[self._rec(record.adapter_id), self._ids],
                args=[record.adapter_id, record.to_json(), record.info.created_at],
            )

    def remove(self, adapter_id: str) -> None:
        with translated(self.description, self._breaker):
            pipe = self._r.pipeline(transaction=True)
            pipe.delete(self._rec(adapter_id))
            pipe.zrem(self._ids, adapter_id)
            pipe.execute()

    def list(self, prefix: str, start_after: str, limit: int) -> list[StoredRecord]:
        if start_after and start_after >= prefix:
            low = b"(" + start_after.encode()  # strictly after the last page
        else:
            low = b"[" + prefix.encode() if prefix else b"-"
        high = b"[" + prefix.encode() + b"\xff" if prefix else b"+"
        with translated(self.description, self._breaker):
            ids = self._r.zrangebylex(self._ids, low, high, start=0, num=limit)
            raws = self._r.mget([self._rec(i.decode()) for i in ids]) if ids else []
        return [StoredRecord.from_json(raw) for raw in raws if raw is not None]

    def is_complete(self) -> bool:
        with translated(self.description, self._breaker):
            return bool(self._r.exists(self._complete))

    def marker(self) -> bytes | None:
        with translated(self.description, self._breaker):
            return self._r.get(self._marker)

    def set_marker(self, data: bytes) -> None:
        with translated(self.description, self._breaker):
            self._r.set(self._marker, data)

    def mark_incomplete(self) -> None:
        with translated(self.description, self._breaker):
            self._r.delete(self._complete)

    def rebuild(self, records: Iterable[StoredRecord], started_at: float) -> None:
        scanned = {r.adapter_id: r for r in records}
        with translated(self.description, self._breaker):
            for record in scanned.values():
                self._upsert(keys=[self._rec(record.adapter_id), self._ids],
                             args=[record.adapter_id, record.to_json(), started_at])
            for raw in self._r.zrange(self._ids, 0, -1):
                adapter_id = raw.decode()
                if adapter_id not in scanned:
                    self._remove_older(keys=[self._rec(adapter_id), self._ids], args=[adapter_id, started_at])
            self._r.set(self._complete, b"1")

    @contextmanager
    def lock(self, adapter_id: str, wait_s: float) -> Iterator[RedisLease]:
        """The writer lease on ``adapter_id`` (redis_lease.py), waiting at most ``wait_s``;
        UnavailableError naming the wait when another writer holds it longer."""
        with translated(self.description, self._breaker):
            lease = acquire_lease(self._r, f"{self._ns}:lock:{adapter_id}", adapter_id, self._lease_s, wait_s)
        if lease is None:
            raise UnavailableError(
                f"adapter {adapter_id!r} is being written by another upload or delete (waited {wait_s:.1f}s "
                "of the caller's deadline); try again"
            )
        try:
            yield lease
        finally:
            lease.release()
