"""The local adapter directory's replaced and deleted version folders, kept a while for readers.

A reader resolves an adapter's link and reads the version folder it names; a re-upload or delete
that swaps or removes the link meanwhile must not pull that folder away. So a folder no link names
is kept RETIRE_S, at most RETIRED_PER_ADAPTER of one adapter, and what a killed process left is
removed at the next start once it is older than RETIRE_S (lora/local_directory.py).
"""

from __future__ import annotations

import os
import shutil
import time
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

# How long a replaced or deleted version's folder outlives its link (a reader that resolved the
# link before the swap reads that folder), and how old a leftover must be before a start removes it.
RETIRE_S = 300.0
# How many replaced versions of one adapter stay within RETIRE_S: rapid re-uploads of one id would
# otherwise keep every version (1,250 folders after 40 s of them); a reader pins the version it
# resolved, which the next swaps retire first, so the oldest past this many go at once.
RETIRED_PER_ADAPTER = 2


class RetiredVersions:
    """Version folders no link names any more, oldest first (the caller serializes the calls)."""

    def __init__(self) -> None:
        self._retired: list[tuple[float, Path]] = []  # (when, version folder)

    def retire(self, version_dir: Path) -> None:
        """No link names ``version_dir`` now: removed once RETIRE_S have passed, or once
        RETIRED_PER_ADAPTER newer versions of its adapter were retired."""
        self._retired.append((time.monotonic(), version_dir))
        self.sweep()

    def sweep(self) -> None:
        """Remove the retired folders whose time is up or that too many newer ones of their adapter follow."""
        now, kept, newer = time.monotonic(), [], Counter()
        for when, path in reversed(self._retired):
            adapter = version_adapter(path)
            newer[adapter] += 1
            if now - when >= RETIRE_S or newer[adapter] > RETIRED_PER_ADAPTER:
                shutil.rmtree(path, ignore_errors=True)
            else:
                kept.append((when, path))
        self._retired = kept[::-1]


def remove_leftovers(staging: Path, versions: Path, links: Iterable[Path]) -> None:
    """At start: staging folders, and version folders none of ``links`` names, older than RETIRE_S
    (a process killed mid-upload or mid-delete left them; younger ones may be another process's)."""
    named = {os.path.realpath(p) for p in links}
    cutoff = time.time() - RETIRE_S
    for parent, keep in ((staging, set()), (versions, named)):
        if not parent.is_dir():
            continue
        for path in parent.iterdir():
            try:
                old = path.lstat().st_mtime < cutoff
            except OSError:
                continue
            if old and os.path.realpath(path) not in keep:
                shutil.rmtree(path, ignore_errors=True)


def version_adapter(version_dir: Path) -> str:
    """The adapter a version folder (``<id with / as __>@<version>-<nonce>``) was written for."""
    return version_dir.name.rpartition("@")[0]
