"""Reading heads straight from the blob backend: one id, a page, or a full scan.

This is how the store answers when the index cannot (Redis down, or not yet built),
and how the index is rebuilt.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from loraplex.adapter_store.backends.base import BlobBackend
from loraplex.adapter_store.errors import AdapterCorruptError
from loraplex.adapter_store.records import StoredRecord

log = logging.getLogger(__name__)
SCAN_PAGE = 1000


class HeadScanner:
    """Parses heads of one blob backend. BackendUnavailable passes through."""

    def __init__(self, blobs: BlobBackend) -> None:
        self._blobs = blobs

    def read(self, adapter_id: str) -> StoredRecord | None:
        """The adapter's current record, or None. A head that does not parse is corruption."""
        raw = self._blobs.read_head(adapter_id)
        return None if raw is None else _parsed(adapter_id, raw, None)

    def read_tagged(self, adapter_id: str) -> tuple[StoredRecord | None, str | None]:
        """The record and its head's tag (what a conditional head write expects), or (None, None).
        An unreadable head raises UnreadableHead, which carries the tag (an upload replaces it)."""
        tagged = self._blobs.read_head_tagged(adapter_id)
        if tagged is None:
            return None, None
        raw, tag = tagged
        return _parsed(adapter_id, raw, tag), tag

    def list(self, prefix: str, start_after: str, limit: int) -> list[StoredRecord]:
        """One page, read head by head (ids whose head vanished meanwhile are skipped)."""
        out = []
        for adapter_id in self._blobs.list_heads(prefix, start_after, limit):
            record = self._read_or_skip(adapter_id)
            if record is not None:
                out.append(record)
        return out

    def scan(self) -> list[StoredRecord]:
        """Every head, in id order."""
        out: list[StoredRecord] = []
        after = ""
        while True:
            ids = self._blobs.list_heads("", after, SCAN_PAGE)
            out.extend(r for r in map(self._read_or_skip, ids) if r is not None)
            if len(ids) < SCAN_PAGE:
                return out
            after = ids[-1]

    def _read_or_skip(self, adapter_id: str) -> StoredRecord | None:
        try:
            return self.read(adapter_id)
        except AdapterCorruptError as e:
            log.error("skipping %s", e)
            return None

    @staticmethod
    def page(records: Sequence[StoredRecord], prefix: str, start_after: str, limit: int) -> list[StoredRecord]:
        """The same page as Index.list, cut from a sorted scan."""
        picked = [r for r in records if r.adapter_id.startswith(prefix) and r.adapter_id > start_after]
        return picked[:limit]


class UnreadableHead(AdapterCorruptError):
    """A head that does not parse; ``tag`` is its tag (None where not read with one)."""

    def __init__(self, message: str, tag: str | None) -> None:
        super().__init__(message)
        self.tag = tag


def _parsed(adapter_id: str, raw: bytes, tag: str | None) -> StoredRecord:
    try:
        return StoredRecord.from_json(raw)
    except (ValueError, TypeError, KeyError) as e:
        raise UnreadableHead(f"adapter {adapter_id!r}: its head record is unreadable ({e})", tag) from None
