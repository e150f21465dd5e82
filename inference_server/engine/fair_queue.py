"""The scheduler's waiting queue, fair across tenants: round-robin between tenants, FCFS within one.

Each tenant (``request.tenant``; None is a tenant of its own) has a FIFO. ``peek`` shows the
head of the tenant whose turn it is; ``popleft`` takes it and sends that tenant to the back
of the rotation. So with k tenants waiting, each one's head is admitted at least once every
k admissions however long the others' queues are: a tenant with hundreds queued cannot
starve one with a single request. A preempted sequence goes back to the front of its
tenant's queue, and its tenant to the front of the rotation.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator

from loraplex.inference_server.engine.sequence import Sequence


def _tenant(seq: Sequence) -> str | None:
    return seq.request.tenant


class FairQueue:
    """Waiting sequences, per tenant; the deque-like subset the scheduler uses."""

    def __init__(self) -> None:
        self._queues: dict[str | None, deque[Sequence]] = {}
        self._turns: deque[str | None] = deque()  # tenants with waiting sequences, next turn first
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __bool__(self) -> bool:
        return self._len > 0

    def __contains__(self, seq: object) -> bool:
        return isinstance(seq, Sequence) and seq in self._queues.get(_tenant(seq), ())

    def __iter__(self) -> Iterator[Sequence]:
        """Every waiting sequence, tenant by tenant in turn order (for inspection, not admission)."""
        for tenant in self._turns:
            yield from self._queues[tenant]

    def __getitem__(self, index: int) -> Sequence:
        """Only index 0 (the next sequence to admit) is supported."""
        if index != 0:
            raise IndexError("FairQueue supports only [0], the next sequence to admit")
        return self.peek()

    def tenants(self) -> dict[str | None, int]:
        """Waiting sequences per tenant."""
        return {t: len(q) for t, q in self._queues.items() if q}

    def append(self, seq: Sequence) -> None:
        """Queue ``seq`` behind its tenant's earlier sequences."""
        queue = self._queue_for(_tenant(seq), front=False)
        queue.append(seq)
        self._len += 1

    def appendleft(self, seq: Sequence) -> None:
        """Put ``seq`` (preempted) first: its tenant's head, and its tenant's turn next."""
        queue = self._queue_for(_tenant(seq), front=True)
        queue.appendleft(seq)
        self._len += 1

    def _queue_for(self, tenant: str | None, front: bool) -> deque[Sequence]:
        queue = self._queues.setdefault(tenant, deque())
        if not queue:
            if front:
                self._turns.appendleft(tenant)
            else:
                self._turns.append(tenant)
        elif front and self._turns[0] != tenant:
            self._turns.remove(tenant)
            self._turns.appendleft(tenant)
        return queue

    def peek(self) -> Sequence:
        if not self._turns:
            raise IndexError("peek from an empty FairQueue")
        return self._queues[self._turns[0]][0]

    def popleft(self) -> Sequence:
        """Take the next sequence; its tenant goes to the back of the rotation."""
        if not self._turns:
            raise IndexError("pop from an empty FairQueue")
        tenant = self._turns.popleft()
        queue = self._queues[tenant]
        seq = queue.popleft()
        self._len -= 1
        if queue:
            self._turns.append(tenant)
        else:
            del self._queues[tenant]
        return seq

    def remove(self, seq: Sequence) -> None:
        """Take ``seq`` out wherever it waits (an aborted request); ValueError if absent."""
        tenant = _tenant(seq)
        queue = self._queues.get(tenant)
        if queue is None:
            raise ValueError("sequence is not waiting")
        queue.remove(seq)
        self._len -= 1
        if not queue:
            del self._queues[tenant]
            self._turns.remove(tenant)
