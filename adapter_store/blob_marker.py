"""Noticing a blob store that lost its objects behind the store's back.

The blob backend is the truth and the index a copy of it, so a bucket that was emptied or
recreated (or a prefix pointed at another store's objects) would otherwise go unseen: the index
would keep listing, and the cache keep serving, adapters whose bytes are gone until they fall
out. So the blob backend holds a small marker object, a random token written once, and the
index remembers it. Upkeep compares the two each round: a marker that vanished, or changed,
while the index still remembers the old one means the objects were lost. That is said in the
log (an error), counted (loraplex_store_blob_store_lost_total), and kept as a health detail;
the index is then rebuilt from what the backend holds now, and watchers get a resync.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable

from loraplex.adapter_store.backends.base import BlobBackend, Index
from loraplex.adapter_store.errors import BackendUnavailable

log = logging.getLogger(__name__)


class BlobMarker:
    """Compares the blob backend's marker with the index's memory of it; ``lost`` says what was
    found (None while nothing was), from the first detection until this process ends."""

    def __init__(self, blobs: BlobBackend, index: Index, on_lost: Callable[[str], None]) -> None:
        self._blobs = blobs
        self._index = index
        self._on_lost = on_lost
        self._lock = threading.Lock()
        self.lost: str | None = None

    def check(self) -> None:
        """One round; a backend that does not answer skips it (its outage is reported elsewhere)."""
        with self._lock:
            try:
                self._compare()
            except BackendUnavailable as e:
                log.debug("blob marker not checked: %s", e)

    def _compare(self) -> None:
        theirs = self._blobs.read_marker()
        ours = self._index.marker()
        if theirs is not None and theirs == ours:
            return
        if theirs is None:
            theirs = self._blobs.create_marker(uuid.uuid4().hex.encode())
            if ours is not None and ours != theirs:
                self._lost(f"{self._blobs.description} lost its objects: its marker object is gone")
        elif ours is not None:
            self._lost(f"{self._blobs.description} holds another store's objects: its marker changed")
        self._index.set_marker(theirs)

    def _lost(self, what: str) -> None:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime())
        self.lost = f"{what} (found {when} UTC); adapters the index listed may be gone"
        log.error("%s; rebuilding the index from what it holds now", self.lost)
        self._on_lost(self.lost)
