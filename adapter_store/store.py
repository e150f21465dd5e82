"""The store: validated uploads, checked reads, listing, deletion and change events.

Plain Python over the four backend interfaces (backends/base.py); synchronous and
thread-safe (the gRPC servicer runs it in worker threads). The blob backend is the
truth: a version's blob is written first, then the adapter's head (the commit point),
then the index, the cache and the change feed; the replaced version's blob goes only where no
other writer can have made it current again (old_versions.py). A delete removes the head (its commit point),
then the index entry, the version's blob (and older leftovers of the id) and publishes; one cut
off after its commit point is finished by the next delete of the id. The index, cache and feed
are optional speed-ups: when one fails the store falls back, counts it and logs it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping

from loraplex.adapter_store.backends.base import BlobBackend, BlobCache, ChangeFeed, Importer, Index
from loraplex.adapter_store.blob_marker import BlobMarker
from loraplex.adapter_store.call_deadline import CallDeadline
from loraplex.adapter_store.degradation import Degradation
from loraplex.adapter_store.errors import (
    AdapterCorruptError,
    AdapterNotFoundError,
    AdapterValidationError,
    BackendUnavailable,
    BlobMissing,
    HeadChanged,
    InvalidRequestError,
    LeaseLost,
    UnavailableError,
)
from loraplex.adapter_store.format.base_shapes import BaseShapes, same_shapes
from loraplex.adapter_store.format.naming import validate_adapter_id
from loraplex.adapter_store.format.peft_format import parse_adapter_upload
from loraplex.adapter_store.index_keeper import IndexKeeper
from loraplex.adapter_store.listing import HeadScanner, UnreadableHead
from loraplex.adapter_store.metrics import StoreMetrics
from loraplex.adapter_store.old_versions import OldVersions, delete_quietly
from loraplex.adapter_store.records import (KIND_DELETE, KIND_PUT, KIND_RESYNC, ChangeEvent, StoredRecord,
                                            check_upload_files)
from loraplex.adapter_store.write_turn import Turn, WriterLocks, superseded

log = logging.getLogger(__name__)
FILL_WAIT_S = 0.5  # an index fill is a speed-up: it does not queue behind a writer for long


class Store:
    """One adapter store over a blob backend, an index, a blob cache and a change feed."""

    def __init__(
        self,
        blobs: BlobBackend,
        index: Index,
        cache: BlobCache,
        feed: ChangeFeed,
        *,
        base: BaseShapes | None = None,
        max_rank: int = 128,
        max_adapter_bytes: int = 1 << 30,
        metrics: StoreMetrics | None = None,
        clock: Callable[[], float] = time.time,
        importer: Importer | None = None,
        reconcile_interval_s: float = 0.0,
    ) -> None:
        self.blobs, self.index, self.cache, self.feed = blobs, index, cache, feed
        self.importer = importer  # reads an S3 prefix for Import (None: this store has no S3 client)
        self.base = base
        self.max_rank = max_rank
        self.max_adapter_bytes = max_adapter_bytes
        self.metrics = metrics if metrics is not None else StoreMetrics()
        self.health = Degradation(self.metrics)
        self._clock = clock
        self._heads = HeadScanner(blobs)
        self.keeper = IndexKeeper(index, self._heads, self.health, clock, blobs.description, reconcile_interval_s)
        self._writers = WriterLocks(index, self.health)
        self.marker = BlobMarker(blobs, index, self._blob_store_lost)
        self._old = OldVersions(blobs, lambda key: self._cache_call(self.cache.discard, key), clock)

    # ------------------------------------------------------------------ writes

    def put(
        self, adapter_id: str, files: Mapping[str, bytes], public: bool = False, digests: Mapping[str, str] | None = None,
        deadline: CallDeadline | None = None, fits: tuple[BaseShapes, int] | None = None,
    ) -> StoredRecord:
        """Validate ``files`` (a PEFT folder) and make them the adapter's new version, readable by
        every tenant when ``public`` (the flag is part of the record: each put sets it anew).
        ``fits``: the uploading server's base model and rank cap, checked in the same one parse
        (they must agree with the store's own base, if it has one).
        ``digests``: the files' sha256, hashed from these very bytes by the caller (an upload
        does, to check them), so they are not hashed again. ``deadline``: the caller's; the
        lock wait ends before it, and the put does not commit once the caller is gone."""
        try:
            validate_adapter_id(adapter_id)
            check_upload_files(files, self.max_adapter_bytes)
            spec = parse_adapter_upload(files, *self._checked_against(fits))
        except InvalidRequestError:
            self.metrics.uploads.labels("invalid").inc()
            raise
        record = StoredRecord.build(adapter_id, files, spec, self._clock(), public, digests)
        blob = record.pack(files)
        deadline = deadline or CallDeadline()
        try:
            with self._writers.hold(adapter_id, deadline.wait_budget()) as lease:
                old, tag = self._head_for_write(adapter_id, "store")
                self._commit(record, blob, old, Turn(tag, lease, deadline))
                self.keeper.write(self.index.put, record)
                self._cache_call(self.cache.put, record.blob_key, blob)
                self._old.after_put(old, record, lease)
                self._publish(ChangeEvent(KIND_PUT, adapter_id, record.version, record.info.sha256, self._clock()))
        except UnavailableError:  # the writer lock not had in time, the blob store down, the turn lost
            self.metrics.uploads.labels("unavailable").inc()
            raise
        self.metrics.uploads.labels("stored").inc()
        log.info("stored %s version %s (%d bytes, %s)", adapter_id, record.version, len(blob),
                 "public" if public else "private")
        return record

    def delete(self, adapter_id: str, deadline: CallDeadline | None = None) -> StoredRecord:
        """Remove the adapter's name and every stored version; returns the record that was current.
        ``deadline`` as for put."""
        validate_adapter_id(adapter_id)
        deadline = deadline or CallDeadline()
        with self._writers.hold(adapter_id, deadline.wait_budget()) as lease:
            record, tag = self._head_for_write(adapter_id, "delete")
            if record is None:
                return self._finish_delete(adapter_id)
            what = f"cannot delete {adapter_id!r}"
            try:
                Turn(tag, lease, deadline).check(what)
                self.blobs.delete_head(adapter_id, expect=tag)  # the commit point
            except BackendUnavailable as e:
                raise self._unavailable(what, e) from e
            except (HeadChanged, LeaseLost) as e:
                raise superseded(what, e) from None
            self.keeper.write(self.index.remove, adapter_id)
            self._old.after_delete(record)
            self._publish(ChangeEvent(KIND_DELETE, adapter_id, record.version, record.info.sha256, self._clock()))
        log.info("deleted %s (was version %s)", adapter_id, record.version)
        return record

    def _finish_delete(self, adapter_id: str) -> StoredRecord:
        """A delete of an id without a head: a delete that stopped after its commit point (the head
        gone, its process killed before the index, the blobs and the change event) left the index
        naming it; this one finishes it (servers holding the old version hear the event) and answers
        as the delete. Nothing in the index either: not found."""
        try:
            stale = self.index.get(adapter_id)
        except BackendUnavailable:
            stale = None
        self.keeper.write(self.index.remove, adapter_id)
        if stale is None:
            raise AdapterNotFoundError(adapter_id)
        self._old.after_delete(stale)
        self._publish(ChangeEvent(KIND_DELETE, adapter_id, stale.version, stale.info.sha256, self._clock()))
        log.info("deleted %s: finished an interrupted delete (the index still named version %s)", adapter_id,
                 stale.version)
        return stale

    def _commit(self, record: StoredRecord, blob: bytes, old: StoredRecord | None, turn: Turn) -> None:
        """Write the blob, then (if this writer's turn still holds) the head, on the condition that
        it is still the one read under the lock. On failure nothing new stays behind."""
        what = f"cannot store {record.adapter_id!r}"
        try:
            self.blobs.write_blob(record.blob_key, blob)
            turn.check(what)
            self.blobs.write_head(record.adapter_id, record.to_json(), expect=turn.tag)
        except BaseException as e:
            if (old is None or old.version != record.version) and not self._head_may_be(record):
                delete_quietly(self.blobs, record.blob_key)
            if isinstance(e, BackendUnavailable):
                raise self._unavailable(what, e) from e
            if isinstance(e, (HeadChanged, LeaseLost)):
                raise superseded(what, e) from None
            raise

    def _head_may_be(self, record: StoredRecord) -> bool:
        """After a failed head write: did it land anyway? (Unknown counts as yes: keep the blob.)"""
        try:
            raw = self.blobs.read_head(record.adapter_id)
        except BackendUnavailable:
            return True
        return raw is not None and StoredRecord.from_json(raw).version == record.version

    def _head_for_write(self, adapter_id: str, what: str) -> tuple[StoredRecord | None, str | None]:
        """The current record and its head's tag (the condition of the commit)."""
        try:
            return self._heads.read_tagged(adapter_id)
        except BackendUnavailable as e:
            raise self._unavailable(f"cannot {what} {adapter_id!r}", e) from e
        except AdapterCorruptError as e:
            if what != "store":
                raise
            log.warning("%s; the new upload replaces it", e)
            return None, e.tag if isinstance(e, UnreadableHead) else None

    def _unavailable(self, what: str, e: BackendUnavailable) -> UnavailableError:
        return UnavailableError(
            f"{what}: the blob store ({e.backend}) is unavailable ({e.detail}); "
            "uploads and deletes need it, cached adapters can still be read"
        )

    # ------------------------------------------------------------------ reads

    def stat(self, adapter_id: str) -> StoredRecord:
        """The current record of ``adapter_id`` (AdapterNotFoundError if none)."""
        validate_adapter_id(adapter_id)
        return self._lookup(adapter_id)

    def fetch(self, adapter_id: str) -> tuple[StoredRecord, dict[str, bytes]]:
        """The current record and its files, checked against their sha256: cache, else blobs."""
        validate_adapter_id(adapter_id)
        record = self._lookup(adapter_id)
        for _ in range(3):
            files = self._from_cache(record)
            if files is not None:
                return record, files
            try:
                blob = self.blobs.read_blob(record.blob_key)
            except BlobMissing:
                record = self._moved_on(record)  # re-uploaded or deleted since the lookup
                continue
            except BackendUnavailable as e:
                raise UnavailableError(
                    f"adapter {adapter_id!r} is not cached and the blob store ({e.backend}) is unreachable "
                    f"({e.detail})"
                ) from e
            files = self._checked(record, [blob], "blobs")
            self._cache_call(self.cache.put, record.blob_key, blob)
            self.metrics.reads.labels("blobs").inc()
            self.metrics.bytes_read.inc(len(blob))
            return record, files
        raise UnavailableError(f"adapter {adapter_id!r} changed three times while being read; try again")

    def _lookup(self, adapter_id: str) -> StoredRecord:
        complete = False
        # An index that missed writes since its last rebuild may be stale (a Redis out of memory
        # answers reads and refuses writes): until the rebuild, the heads answer.
        if not self.keeper.missed_writes:
            try:
                record = self.index.get(adapter_id)
                self.health.ok("index")
                if record is not None:
                    return record
                complete = self.index.is_complete()
            except BackendUnavailable as e:
                self.health.fell_back("index", e)
        try:
            record = self._heads.read(adapter_id)
        except BackendUnavailable as e:
            if complete:
                raise AdapterNotFoundError(adapter_id) from None
            raise UnavailableError(
                f"adapter {adapter_id!r}: neither the index nor the blob store ({e.backend}) can be read ({e.detail})"
            ) from e
        if record is None:
            raise AdapterNotFoundError(adapter_id)
        self._fill_index(record)
        return record

    def _fill_index(self, record: StoredRecord) -> None:
        """Put a record read from its head into the index, unless a write replaced or deleted it
        since: under the adapter's write lock (writes hold it over head and index), the head is read
        again and the record filled only if it is still current (else a delete that completed
        between the read and the fill was undone in the index)."""
        try:
            with self._writers.hold(record.adapter_id, FILL_WAIT_S):
                self._fill_if_current(record)
        except UnavailableError:
            return  # a writer holds the id: not filled, the index stays a miss, which reads the head again

    def _fill_if_current(self, record: StoredRecord) -> None:
        try:
            current = self._heads.read(record.adapter_id)
        except BackendUnavailable:
            return  # not filled: the index stays a miss, which reads the head again
        if current is not None and current.version == record.version:
            self.keeper.write(self.index.fill, current, lost_ok=True)

    def _from_cache(self, record: StoredRecord) -> dict[str, bytes] | None:
        pieces = self._cache_call(self.cache.pieces, record.blob_key)
        if pieces is None:
            return None
        try:  # the pieces are read as they are checked: a cache outage can surface here too
            files = self._cache_call(self._checked, record, pieces, "cache")
        except AdapterCorruptError:
            self._cache_call(self.cache.discard, record.blob_key)
            return None  # read it from the blob store instead
        if files is None:
            return None
        self.metrics.reads.labels("cache").inc()
        self.metrics.bytes_read.inc(record.blob_size)
        return files

    def _checked(self, record: StoredRecord, pieces: Iterable[bytes], where: str) -> dict[str, bytes]:
        try:
            return record.unpack_pieces(pieces)
        except AdapterCorruptError as e:
            self.metrics.checksum_failures.labels(where).inc()
            log.error("checksum failure in the %s: %s", where, e)
            raise

    def _moved_on(self, record: StoredRecord) -> StoredRecord:
        try:
            fresh = self._heads.read(record.adapter_id)
        except BackendUnavailable as e:
            raise UnavailableError(f"adapter {record.adapter_id!r}: blob store unreachable ({e.detail})") from e
        if fresh is None:
            self.keeper.write(self.index.remove, record.adapter_id, lost_ok=True)
            raise AdapterNotFoundError(record.adapter_id)
        if fresh.version == record.version:
            self.metrics.checksum_failures.labels("missing").inc()
            raise AdapterCorruptError(
                f"adapter {record.adapter_id!r} version {record.version}: its blob is missing from {self.blobs.description}"
            )
        self.keeper.write(self.index.fill, fresh, lost_ok=True)
        return fresh

    def list(self, prefix: str = "", start_after: str = "", limit: int = 100) -> list[StoredRecord]:
        """Up to ``limit`` records whose id starts with ``prefix``, after ``start_after``, in id order."""
        return self.keeper.list(prefix, start_after, limit)

    def maintain(self) -> None:
        """Periodic upkeep: check the blob store still holds its objects (blob_marker.py), and rebuild
        the index from it when it missed writes, was emptied, or the blob store lost objects; at
        start and every reconcile interval, reconcile it with the heads, telling watchers to
        re-check their copies when it had been wrong."""
        self.marker.check()
        if self.keeper.maintain():
            self._publish(ChangeEvent(KIND_RESYNC))

    def _blob_store_lost(self, what: str) -> None:
        """The blob store lost objects behind the index's back: count it, stop trusting the index
        (rebuilt at once from what is there), and tell watchers to re-check their copies."""
        self.metrics.blob_store_lost.inc()
        self.keeper.write(self.index.mark_incomplete)
        self.keeper.maintain()
        self._publish(ChangeEvent(KIND_RESYNC))

    def health_details(self) -> dict[str, str]:
        """Problems an operator must hear of, by name (empty while there are none)."""
        return {"blob-store": self.marker.lost} if self.marker.lost else {}

    def check_backends(self) -> None:
        """At start, one rule: a backend whose answer says a setting is wrong (S3: no such
        bucket, no credentials, credentials refused; ``BackendUnavailable.fix``) is a ValueError
        naming the fix, since waiting will not mend it; a backend that does not answer (an outage)
        is a warning, and the store serves anyway and recovers when it answers."""
        try:
            self.blobs.list_heads("", "", 1)
        except BackendUnavailable as e:
            if e.fix is not None:
                raise ValueError(_misconfigured(e)) from None
            log.warning("at start: %s; serving, and the calls that need it fail with UNAVAILABLE until it answers", e)
        try:
            self.index.is_complete()
        except BackendUnavailable as e:
            log.warning("at start: %s; serving without it until it answers", e)

    # ------------------------------------------------------------------ events and helpers

    def _checked_against(self, fits: tuple[BaseShapes, int] | None) -> tuple[BaseShapes | None, int]:
        """(base, rank cap) an upload is parsed against: the uploader's, within the store's own."""
        if fits is None:
            return self.base, self.max_rank
        base, max_rank = fits
        if self.base is not None and not same_shapes(self.base, base):
            raise AdapterValidationError(f"the uploading server's base model ({base.model_type}, {base.num_layers} "
                                         f"layers) is not this store's --base-config ({self.base.model_type}, "
                                         f"{self.base.num_layers} layers)")
        return base, min(max_rank, self.max_rank)

    def subscribe(self, callback: Callable[[ChangeEvent], None]) -> Callable[[], None]:
        """Change events (from any thread), starting with a resync; returns the unsubscribe function."""
        return self.feed.subscribe(callback)

    def close(self) -> None:
        self.feed.close()

    def _publish(self, event: ChangeEvent) -> None:
        if not self.feed.publish(event):
            self.health.fell_back("feed", RuntimeError("change published to local watchers only"))

    def _cache_call(self, fn: Callable[..., object], *args: object) -> object:
        try:
            result = fn(*args)
        except BackendUnavailable as e:
            self.health.fell_back("cache", e)
            return None
        self.health.ok("cache")
        return result



def _misconfigured(e: BackendUnavailable) -> str:
    """The start-up refusal for a backend set up wrong: what it answered, and the fix."""
    if e.detail.startswith("NoSuchBucket"):
        return f"{e.backend} does not exist: {e.fix}"
    return f"{e.backend}: {e.detail.split(': ', 1)[0]}: {e.fix}"
