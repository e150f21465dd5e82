"""First-fit allocator of element ranges in the flat adapter pool (plain Python).

Adapters of any rank take exactly the elements they need (no padding to a max rank);
freed ranges coalesce with their neighbours.
"""

from __future__ import annotations

import bisect


class RangeAllocator:
    def __init__(self, capacity: int, align: int = 64) -> None:
        if capacity <= 0:
            raise ValueError(f"pool capacity must be > 0 elements, got {capacity}")
        self.capacity = capacity
        self.align = align
        self._free: list[tuple[int, int]] = [(0, capacity)]  # sorted (start, size)
        self._used: dict[int, int] = {}  # start -> size

    @property
    def used(self) -> int:
        return sum(self._used.values())

    @property
    def largest_free(self) -> int:
        return max((size for _, size in self._free), default=0)

    def _round(self, size: int) -> int:
        return -(-size // self.align) * self.align

    def alloc(self, size: int) -> int | None:
        """Start of a free range of ``size`` elements, or None if no range is large enough."""
        size = self._round(max(size, 1))
        for i, (start, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (start + size, free - size)
                self._used[start] = size
                return start
        return None

    def free(self, start: int) -> None:
        size = self._used.pop(start)
        i = bisect.bisect_left(self._free, (start, 0))
        self._free.insert(i, (start, size))
        self._merge(i)

    def _merge(self, i: int) -> None:
        if i + 1 < len(self._free) and self._free[i][0] + self._free[i][1] == self._free[i + 1][0]:
            self._free[i] = (self._free[i][0], self._free[i][1] + self._free[i + 1][1])
            del self._free[i + 1]
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == self._free[i][0]:
            self._free[i - 1] = (self._free[i - 1][0], self._free[i - 1][1] + self._free[i][1])
            del self._free[i]
