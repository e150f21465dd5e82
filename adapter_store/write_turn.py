"""A writer's turn on one adapter id: how it is taken, and what is checked before its commit.

The turn is the id's lock in this process (id_locks.py) and, where the index is shared, its
lease across processes (backends/redis_lease.py), both taken within the caller's deadline.
Just before the commit point the writer checks that its caller is still there, that its lease
still holds, and (in the head write itself) that the head is still the one it read.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from loraplex.adapter_store.backends.base import UNGUARDED, Index, WriterLease
from loraplex.adapter_store.call_deadline import CallDeadline
from loraplex.adapter_store.degradation import Degradation
from loraplex.adapter_store.errors import BackendUnavailable, UnavailableError
from loraplex.adapter_store.id_locks import IdLocks


class WriterLocks:
    """Takes writers' turns on adapter ids over ``index``'s locks; a down index is a fallback."""

    def __init__(self, index: Index, health: Degradation) -> None:
        self._index = index
        self._health = health
        self._local = IdLocks()

    @contextmanager
    def hold(self, adapter_id: str, wait_s: float) -> Iterator[WriterLease]:
        """The id's lock in this process, then its lease across processes (where the index is
        shared), both within ``wait_s``; UnavailableError when another writer holds it longer."""
        started = time.monotonic()
        with self._local.hold(adapter_id, wait_s) as held, ExitStack() as stack:
            if not held:
                raise UnavailableError(
                    f"adapter {adapter_id!r} is being written by another upload or delete (waited {wait_s:.1f}s "
                    "of the caller's deadline); try again"
                )
            left = max(0.0, wait_s - (time.monotonic() - started))
            try:
                lease = stack.enter_context(self._index.lock(adapter_id, left))
            except BackendUnavailable as e:
                # other processes cannot be excluded now; the conditional head write still guards the commit
                self._health.fell_back("index", e)
                lease = UNGUARDED
            yield lease


class Turn:
    """What a writer checks just before its commit point: the caller is still there, its lease
    still holds, and (in the write itself) the head is still ``tag``, the one read under the lock."""

    def __init__(self, tag: str | None, lease: WriterLease, deadline: CallDeadline) -> None:
        self.tag = tag
        self._lease = lease
        self._deadline = deadline

    def check(self, what: str) -> None:
        self._deadline.check_commit(what)
        self._lease.check()


def superseded(what: str, e: Exception) -> UnavailableError:
    """The error of a write that lost its turn (lease taken over, or the head changed under it)."""
    return UnavailableError(f"{what}: {e}; another writer may have committed since, so nothing was changed; try again")
