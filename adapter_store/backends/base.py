"""The four small interfaces the store is built on. Every method is synchronous and
thread-safe; an unreachable dependency raises BackendUnavailable, never its client's error.

- BlobBackend: the durable source of truth (local directory or S3): version blobs, and one
  small "head" object per adapter id naming its current version (the commit point).
- Index: a fast copy of the heads (memory or Redis), rebuildable from the blob backend.
- BlobCache: a bounded cache of hot blobs, evicted by size in LRU order (memory or Redis).
- ChangeFeed: change events to every subscriber (in process, or all processes via Redis).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager
from typing import Protocol

from loraplex.adapter_store.records import ChangeEvent, StoredRecord

ANY_HEAD = object()  # write_head / delete_head without a condition


class BlobBackend(Protocol):
    description: str  # for messages: "S3 bucket 'b' at http://..." or "local directory /x"

    def write_blob(self, key: str, data: bytes) -> None:
        """Store ``data`` under ``key``; visible only once complete."""

    def read_blob(self, key: str) -> bytes:
        """The blob's bytes; BlobMissing if there is none."""

    def delete_blob(self, key: str) -> None:
        """Remove a blob (no error if absent)."""

    def list_blobs(self, adapter_id: str, modified_before: float | None = None) -> list[str]:
        """Keys of every stored version of ``adapter_id``; with ``modified_before`` (a Unix time),
        of those last written before it."""

    def write_head(self, adapter_id: str, data: bytes, expect: str | None | object = ANY_HEAD) -> None:
        """Atomically replace the head (current record) of ``adapter_id``. With ``expect`` (a tag
        from read_head_tagged, or None for "no head yet") only if the head is still that one,
        else HeadChanged: a writer whose turn ran out never overwrites a newer commit."""

    def read_head(self, adapter_id: str) -> bytes | None:
        """The head, or None if the id has none."""

    def read_head_tagged(self, adapter_id: str) -> tuple[bytes, str] | None:
        """The head and a tag that changes whenever the head does (S3: its ETag), or None."""

    def delete_head(self, adapter_id: str, expect: str | None | object = ANY_HEAD) -> None:
        """Remove the head (no error if absent); with ``expect``, only if it is still that one."""

    def list_heads(self, prefix: str, start_after: str, limit: int) -> list[str]:
        """Up to ``limit`` ids with a head, starting with ``prefix``, after ``start_after``,
        in byte order."""

    def create_marker(self, data: bytes) -> bytes:
        """Store the backend's marker (blob_marker.py) unless it has one; returns the one it has."""

    def read_marker(self) -> bytes | None:
        """The backend's marker, or None (never written, or lost with everything else)."""


class Index(Protocol):
    def get(self, adapter_id: str) -> StoredRecord | None: ...

    def put(self, record: StoredRecord) -> None: ...

    def fill(self, record: StoredRecord) -> None:
        """Add a record read from the blob backend, unless the index holds a newer one."""

    def remove(self, adapter_id: str) -> None: ...

    def list(self, prefix: str, start_after: str, limit: int) -> list[StoredRecord]:
        """Like BlobBackend.list_heads, with the records."""

    def is_complete(self) -> bool:
        """True when the index holds every head (it was rebuilt and no write was lost since)."""

    def mark_incomplete(self) -> None: ...

    def marker(self) -> bytes | None:
        """The blob backend's marker as this index last saw it (blob_marker.py), or None."""

    def set_marker(self, data: bytes) -> None: ...

    def rebuild(self, records: Iterable[StoredRecord], started_at: float) -> None:
        """Load a full scan of the heads taken from ``started_at``; entries written after that
        by others win over the scan. Marks the index complete."""

    def lock(self, adapter_id: str, wait_s: float) -> AbstractContextManager[WriterLease]:
        """Serialises writers of one adapter id (across processes where the index is shared),
        waiting at most ``wait_s`` (UnavailableError after that)."""


class WriterLease(Protocol):
    # whether holding it excludes every other writer of the id (False: a fallback that cannot)
    exclusive: bool

    def check(self) -> None:
        """Before a commit: raise LeaseLost unless this writer still holds the id."""


class _NoLease:
    """The lease of an index that one process owns: the in-process lock is the whole story."""

    exclusive = True

    def check(self) -> None:
        return None


class _Unguarded:
    """The stand-in while a shared index is down: other processes' writers are not excluded
    (the conditional head write still guards each commit, nothing guards what follows it)."""

    exclusive = False

    def check(self) -> None:
        return None


NO_LEASE = _NoLease()
UNGUARDED = _Unguarded()


class BlobCache(Protocol):
    capacity: int

    def get(self, key: str) -> bytes | None:
        """The cached blob (and mark it recently used), or None."""

    def pieces(self, key: str) -> Iterator[bytes] | None:
        """The cached blob as consecutive pieces, read ahead while the caller consumes them (and
        mark it recently used), or None. A piece comes short if the blob is evicted meanwhile:
        the caller checks the total (StoredRecord.unpack_pieces does)."""

    def put(self, key: str, data: bytes) -> bool:
        """Cache ``data``, evicting least recently used blobs until the total fits;
        False (nothing cached) for a blob larger than the capacity."""

    def discard(self, key: str) -> None: ...


class ChangeFeed(Protocol):
    def publish(self, event: ChangeEvent) -> bool:
        """Deliver to every subscriber; False if only local subscribers could be reached."""

    def subscribe(self, callback: Callable[[ChangeEvent], None]) -> Callable[[], None]:
        """Call ``callback`` (from any thread) for each event, starting with a ``resync``
        once the feed is live; returns the function that unsubscribes."""

    def close(self) -> None: ...


class Importer(Protocol):
    def read(self, source: str, max_bytes: int) -> dict[str, bytes]:
        """The files of the adapter at ``source`` (e.g. ``s3://bucket/prefix``), at most
        ``max_bytes`` together; InvalidRequestError naming ``source`` for one it cannot read."""
