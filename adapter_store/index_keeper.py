"""The index as a rebuildable copy of the heads: writes it may miss, listing with a fallback
to the blob store, and rebuilds (at start, after lost writes, after a Redis restart, and every
``reconcile_s``: a store killed between a head and its index write, or a Redis restored from an
older snapshot, leaves an index that says nothing is wrong)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from loraplex.adapter_store.backends.base import Index
from loraplex.adapter_store.degradation import Degradation
from loraplex.adapter_store.errors import BackendUnavailable, UnavailableError
from loraplex.adapter_store.listing import HeadScanner
from loraplex.adapter_store.records import StoredRecord

log = logging.getLogger(__name__)


class IndexKeeper:
    """Keeps ``index`` in step with the heads that ``heads`` reads from the blob store."""

    def __init__(
        self, index: Index, heads: HeadScanner, health: Degradation, clock: Callable[[], float], blobs: str,
        reconcile_s: float = 0.0,
    ) -> None:
        self.index = index
        self._heads = heads
        self.health = health
        self._clock = clock
        self._blobs = blobs
        self._reconcile_s = reconcile_s  # 0: rebuild only when the index says it needs it
        self._reconciled_at: float | None = None  # None: not yet (the first maintain does, at start)
        self._dirty = threading.Event()  # an index write was lost: rebuild once it is back

    @property
    def missed_writes(self) -> bool:
        """An index write was lost since the last rebuild: until the next, the index may be stale
        (a Redis out of memory answers reads and refuses writes), so lookups read the heads."""
        return self._dirty.is_set()

    def write(self, fn: Callable[..., object], *args: object, lost_ok: bool = False) -> None:
        """Apply one index write; if the index is down, note it (and unless ``lost_ok``, rebuild later)."""
        try:
            fn(*args)
        except BackendUnavailable as e:
            self.health.fell_back("index", e)
            if not lost_ok:
                self._dirty.set()

    def list(self, prefix: str, start_after: str, limit: int) -> list[StoredRecord]:
        """Up to ``limit`` records whose id starts with ``prefix``, after ``start_after``, in id order."""
        try:
            complete = self.index.is_complete() and not self._dirty.is_set()
            if not complete:
                scanned = self.rebuild()
                if scanned is not None:
                    return self._heads.page(scanned, prefix, start_after, limit)
            return self.index.list(prefix, start_after, limit)
        except BackendUnavailable as e:
            self.health.fell_back("index", e)
        try:
            return self._heads.list(prefix, start_after, limit)
        except BackendUnavailable as e:
            raise UnavailableError(
                f"cannot list adapters: the index is unreachable and so is the blob store ({e.detail})"
            ) from e

    def rebuild(self) -> list[StoredRecord] | None:
        """Reload the index from a scan of the heads. Returns the scan if the index could not
        take it (so the caller can still answer); raises UnavailableError if the scan failed."""
        started = self._clock()
        lost_before = self._dirty.is_set()
        self._dirty.clear()  # writes lost from now on are flagged again
        try:
            scanned = self._heads.scan()
            self.index.rebuild(scanned, started)
        except BackendUnavailable as e:
            if lost_before:
                self._dirty.set()
            if e.backend == self._blobs:
                raise UnavailableError(f"cannot build the adapter index: {e}") from e
            self.health.fell_back("index", e)
            return scanned
        log.info("index rebuilt from %s: %d adapters", self._blobs, len(scanned))
        return None

    def maintain(self) -> bool:
        """Periodic upkeep: once the index is reachable again after lost writes (or after a Redis
        restart emptied it), rebuild it from the blob store; at the first call and every
        ``reconcile_s`` reconcile it with the heads whatever it says. True when a reconcile found
        the index naming what the heads do not (a version, or an id): copies read from it may be stale."""
        try:
            if self._dirty.is_set():
                self.index.mark_incomplete()
            if self._reconcile_due():
                return self._reconcile()
            if not self.index.is_complete():
                self.rebuild()
            self.health.ok("index")
        except BackendUnavailable as e:
            log.debug("maintain: index still unreachable (%s)", e)
        except UnavailableError as e:
            log.debug("maintain: %s", e)
        return False

    def _reconcile_due(self) -> bool:
        if self._reconciled_at is None:
            return True
        return self._reconcile_s > 0 and self._clock() - self._reconciled_at >= self._reconcile_s

    def _reconcile(self) -> bool:
        """A rebuild from the heads, comparing what the index named before it (raises as rebuild)."""
        started = self._clock()  # what is written after this, the rebuild leaves alone
        before = {r.adapter_id: r.version for r in self.index.list("", "", 1 << 30)}
        scanned = self._heads.scan()
        self.index.rebuild(scanned, started)
        self._reconciled_at = started
        self.health.ok("index")
        after = {r.adapter_id: r.version for r in scanned}
        stale = sorted(i for i in before.keys() | after.keys() if before.get(i) != after.get(i))
        if stale and before:
            log.warning("index reconciled with %s: %d adapters differed from it (%s)", self._blobs, len(stale),
                        ", ".join(stale[:5]) + (", ..." if len(stale) > 5 else ""))
        return bool(stale) and bool(before)
