"""Removing versions a write left behind, never one that may be current.

A version's blob key is its adapter id and content version (records.blob_key), so two uploads of
the same content write the same key. After a put replaces version v1 by v2, a writer that the put
could not exclude (the shared index down, or the put's lease run out) may upload v1's content again
and commit it: dropping "the old version" then deletes the blob the head names. So a replaced
version is dropped at once only by a writer that still holds an exclusive turn and reads a head
that is not that version; otherwise it stays, for the sweep of versions older than ORPHAN_GRACE_S
that later writes of the id run.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from loraplex.adapter_store.backends.base import BlobBackend, WriterLease
from loraplex.adapter_store.errors import AdapterCorruptError, BackendUnavailable, LeaseLost
from loraplex.adapter_store.listing import HeadScanner
from loraplex.adapter_store.records import StoredRecord

log = logging.getLogger(__name__)

# A sweep drops the versions of an id it finds (left behind by failed drops, crashed writers or
# unguarded puts) only once they are this old: a blob written since may be another writer's upload
# on its way to the head (a lease that ran out, or no Redis to hold one).
ORPHAN_GRACE_S = 600.0


class OldVersions:
    """Drops stored versions of adapter ids: the blob, and its cache entry through ``discard``."""

    def __init__(self, blobs: BlobBackend, discard: Callable[[str], object], clock: Callable[[], float]) -> None:
        self._blobs = blobs
        self._heads = HeadScanner(blobs)
        self._discard = discard
        self._clock = clock

    def after_put(self, old: StoredRecord | None, new: StoredRecord, lease: WriterLease) -> None:
        """After ``new``'s commit, while the turn is held: drop ``old`` (the version it replaced)
        and the id's leftovers older than ORPHAN_GRACE_S, unless the turn may not exclude other
        writers now, and never the version the head names when read last."""
        kept = "nothing" if old is None or old.version == new.version else f"version {old.version}"
        if not lease.exclusive:
            log.info("stored %s without an exclusive turn (the shared index is down): %s is left for a later "
                     "write's sweep", new.adapter_id, kept)
            return
        try:
            lease.check()
        except LeaseLost as e:
            log.warning("stored %s, then lost the turn (%s): %s is left for a later write's sweep",
                        new.adapter_id, e, kept)
            return
        keys = set(self._listed(new.adapter_id))
        if old is not None:
            keys.add(old.blob_key)
        self._drop_unless_current(new.adapter_id, keys - {new.blob_key})

    def after_delete(self, record: StoredRecord) -> None:
        """After a delete's commit: the deleted version's blob, and other versions of the id older
        than ORPHAN_GRACE_S (never a blob another writer may be committing now)."""
        self._drop_unless_current(record.adapter_id, {record.blob_key, *self._listed(record.adapter_id)})

    def _drop_blob(self, key: str) -> None:
        """One version's blob and its cache entry (a failure is logged: a later sweep retries)."""
        self._discard(key)
        delete_quietly(self._blobs, key)

    def _drop_unless_current(self, adapter_id: str, keys: set[str]) -> None:
        """Drop ``keys`` but the one the head names now (read last, just before); none when the head
        cannot be read (a later write's sweep retries)."""
        if not keys:
            return
        current = self._current_key(adapter_id)
        if current is None:
            return
        for key in sorted(keys - {current}):
            self._drop_blob(key)

    def _listed(self, adapter_id: str) -> list[str]:
        try:
            return self._blobs.list_blobs(adapter_id, modified_before=self._clock() - ORPHAN_GRACE_S)
        except BackendUnavailable as e:
            log.warning("%s: could not list old versions (%s)", adapter_id, e)
            return []

    def _current_key(self, adapter_id: str) -> str | None:
        """The blob key the head names now ("" when there is no head); None when it cannot be
        told (unreadable), so nothing is dropped."""
        try:
            record = self._heads.read(adapter_id)
            return "" if record is None else record.blob_key
        except (BackendUnavailable, AdapterCorruptError) as e:
            log.warning("%s: the head could not be read before dropping old versions (%s); they stay", adapter_id, e)
            return None


def delete_quietly(blobs: BlobBackend, key: str) -> None:
    """Delete one version's blob; a failure is logged (what it left is for a later sweep)."""
    try:
        blobs.delete_blob(key)
    except BackendUnavailable as e:
        log.warning("deleting blob %s failed: %s (left for a later sweep)", key, e)
