"""Hand edits of a local adapter directory reach the adapter pool.

A folder put in ``--adapter-dir`` by hand may be replaced or edited in place while the server
runs (a new ``save_pretrained`` into it). Writes through the server invalidate the pool's copy
themselves (``ManagedAdapters``); these do not, so ``FolderWatcher`` reads every held adapter's
version again each ``poll_s`` (a stat of its files when they did not change: the directory
keeps what it read by their sizes and times) and invalidates one whose version changed or whose
folder went away. Requests running on the old copy finish on it; the next ones load the new.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping

from loraplex.adapter_store.errors import AdapterNotFoundError, LoraplexError
from loraplex.inference_server.lora.local_directory import LocalAdapterDirectory

log = logging.getLogger(__name__)

POLL_S = 1.0


class FolderWatcher:
    """Calls ``invalidate(id)`` for each held adapter (``held()``: {id: version}) whose folder
    in ``source`` now holds another version, or none."""

    def __init__(self, source: LocalAdapterDirectory, held: Callable[[], Mapping[str, str]],
                 invalidate: Callable[[str], None], poll_s: float = POLL_S) -> None:
        self._source = source
        self._held = held
        self._invalidate = invalidate
        self._poll_s = poll_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> FolderWatcher:
        self._thread = threading.Thread(target=self._run, name="adapter-folder-watcher", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)

    def _run(self) -> None:
        while not self._stop.wait(self._poll_s):
            try:
                self.check_once()
            except Exception:  # noqa: BLE001  (the watcher outlives one bad pass)
                log.exception("checking the adapter directory for changes failed")

    def check_once(self) -> list[str]:
        """One pass: the ids invalidated."""
        changed = []
        for adapter_id, version in self._held().items():
            try:
                current: str | None = self._source.get(adapter_id).version
            except AdapterNotFoundError:
                current = None
            except LoraplexError as exc:  # half-written or invalid now: its next load says why
                log.warning("adapter %s changed on disk and cannot be read now (%s)", adapter_id, exc)
                current = None
            if current != version:
                log.info("adapter %s changed on disk (version %s -> %s): the next requests load it again",
                         adapter_id, version, current or "none")
                self._invalidate(adapter_id)
                changed.append(adapter_id)
        return changed
