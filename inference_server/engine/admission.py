"""Room for one more stream: the engine holds at most ``capacity`` streams (running + waiting),
and with tenants a full engine still lets in a tenant holding less than its fair share.

Without the share, one tenant's streams could fill the engine and every other tenant got
RESOURCE_EXHAUSTED ("request queue is full"), though the scheduler serves tenants round-robin
once admitted (one tenant's three streams locked out another's). A full engine admits a stream of
a tenant holding fewer than capacity / (tenants holding streams, counting it) of them; the others
wait for the total to drop below capacity. Streams are cheap to hold (a prompt and a queue), and
the total never passes twice the capacity."""

from __future__ import annotations

from collections import Counter


class Admission:
    """Counts streams by tenant (None: no tenants, the plain capacity)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._held: Counter[str | None] = Counter()
        self._total = 0

    def room_for(self, tenant: str | None) -> bool:
        if self._total < self.capacity:
            return True
        if tenant is None or self._total >= 2 * self.capacity:
            return False
        held = self._held[tenant]
        active = sum(1 for t, n in self._held.items() if t is not None and n > 0) + (held == 0)
        return held < self.capacity // active

    def opened(self, tenant: str | None) -> None:
        self._held[tenant] += 1
        self._total += 1

    def closed(self, tenant: str | None) -> None:
        self._held[tenant] -= 1
        self._total -= 1
        if self._held[tenant] == 0:
            del self._held[tenant]
