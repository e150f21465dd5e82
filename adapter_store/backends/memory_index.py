"""In-memory index (the default): a dict and a sorted id list, guarded by one lock."""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext

from loraplex.adapter_store.backends.base import NO_LEASE, WriterLease
from loraplex.adapter_store.records import StoredRecord


class MemoryIndex:
    """The heads of this process's blob backend; complete once rebuilt, kept by every write."""

    def __init__(self) -> None:
        self._records: dict[str, StoredRecord] = {}
        self._ids: list[str] = []
        self._complete = False
        self._marker: bytes | None = None
        self._mutex = threading.Lock()

    def marker(self) -> bytes | None:
        return self._marker

    def set_marker(self, data: bytes) -> None:
        self._marker = data

    def get(self, adapter_id: str) -> StoredRecord | None:
        with self._mutex:
            return self._records.get(adapter_id)

    def put(self, record: StoredRecord) -> None:
        with self._mutex:
            self._put(record)

    def fill(self, record: StoredRecord) -> None:
        with self._mutex:
            current = self._records.get(record.adapter_id)
            if current is None or current.info.created_at <= record.info.created_at:
                self._put(record)

    def _put(self, record: StoredRecord) -> None:
        if record.adapter_id not in self._records:
            bisect.insort(self._ids, record.adapter_id)
        self._records[record.adapter_id] = record

    def remove(self, adapter_id: str) -> None:
        with self._mutex:
            self._remove(adapter_id)

    def _remove(self, adapter_id: str) -> None:
        if self._records.pop(adapter_id, None) is not None:
            self._ids.pop(bisect.bisect_left(self._ids, adapter_id))

    def list(self, prefix: str, start_after: str, limit: int) -> list[StoredRecord]:
        with self._mutex:
            if start_after >= prefix:
                i = bisect.bisect_right(self._ids, start_after)  # strictly after the last page
            else:
                i = bisect.bisect_left(self._ids, prefix)
            out = []
            while i < len(self._ids) and len(out) < limit and self._ids[i].startswith(prefix):
                out.append(self._records[self._ids[i]])
                i += 1
            return out

    def is_complete(self) -> bool:
        with self._mutex:
            return self._complete

    def mark_incomplete(self) -> None:
        with self._mutex:
            self._complete = False

    def rebuild(self, records: Iterable[StoredRecord], started_at: float) -> None:
        scanned = {r.adapter_id: r for r in records}
        with self._mutex:
            for adapter_id, record in list(self._records.items()):
                if adapter_id not in scanned and record.info.created_at < started_at:
                    self._remove(adapter_id)
            for record in scanned.values():
                current = self._records.get(record.adapter_id)
                if current is None or current.info.created_at <= record.info.created_at:
                    self._put(record)
            self._complete = True

    def lock(self, adapter_id: str, wait_s: float) -> AbstractContextManager[WriterLease]:
        """Nothing to do: one process owns this index, and the store serialises its own writers."""
        return nullcontext(NO_LEASE)
