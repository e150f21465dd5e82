"""How long the caller of a write still waits, and whether it has gone.

A write runs in a worker thread that gRPC cannot stop: when the caller's deadline passes or
it cancels, the thread goes on. The write therefore carries a CallDeadline and asks it before
each step that makes the caller wait (the writer lock) and before its commit point, so that a
write its caller was told failed never commits later.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from loraplex.adapter_store.errors import UnavailableError

# A commit is not started with less time left than this: the head write itself needs a moment,
# and the caller must not hear "deadline exceeded" for a write that then lands.
COMMIT_MARGIN_S = 1.0
# Without a caller's deadline (an in-process caller), a lock wait gives up after this.
DEFAULT_WAIT_S = 30.0


class CallDeadline:
    """The caller's deadline (monotonic seconds, or None for none) and a cancelled flag."""

    def __init__(self, timeout_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        if timeout_s is not None and timeout_s != timeout_s:  # NaN
            raise ValueError("timeout_s must be a number of seconds or None")
        self._clock = clock
        self._expires = None if timeout_s is None else clock() + timeout_s
        self._cancelled = threading.Event()

    def cancel(self) -> None:
        """The caller went away (cancelled, or its deadline passed at the edge)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def remaining(self) -> float | None:
        """Seconds left (0 once expired); None when there is no deadline."""
        if self._expires is None:
            return None
        return max(0.0, self._expires - self._clock())

    def wait_budget(self, margin_s: float = COMMIT_MARGIN_S) -> float:
        """How long a wait (a lock) may take and still leave ``margin_s`` to finish the call."""
        left = self.remaining()
        return DEFAULT_WAIT_S if left is None else max(0.0, left - margin_s)

    def check_commit(self, what: str) -> None:
        """Raise UnavailableError unless the caller is still there with time to hear the answer."""
        if self.cancelled:
            raise UnavailableError(f"{what}: the caller cancelled before the commit; nothing was stored")
        left = self.remaining()
        if left is not None and left < COMMIT_MARGIN_S:
            raise UnavailableError(
                f"{what}: the caller's deadline leaves {left:.1f}s, under the {COMMIT_MARGIN_S}s a commit "
                "needs; nothing was stored"
            )
