"""An adapter resident in the GPU pool. The pool (pool/) makes a ``ResidentAdapter`` (its
bookkeeping: references, readiness, LRU time) and its ``AdapterPlacement`` (where each target's
A and B start, its ranks and scales): the one type the step plan carries to the batch tables
(batch.py), pickled as it is to the other tensor-parallel ranks."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class AdapterLayout:
    """Where each LoRA target's A and B start (elements, relative to the adapter's base), one
    entry a target of the base family, in its table order (architectures.py)."""

    ranks: tuple[int, ...]  # [P], 0 = target not adapted
    scales: tuple[float, ...]  # [P]
    a_offsets: tuple[int, ...]  # [P]
    b_offsets: tuple[int, ...]  # [P]
    num_elements: int


@dataclass(frozen=True, eq=False, slots=True)
class AdapterPlacement:
    """What the per-step LoRA tables read of a resident adapter: each target's A and B offsets
    (elements into the pool; the same on every tensor-parallel rank, each holding its shard at
    the same place), rank (0 = not adapted) and scale. Sequences of one adapter share one object,
    so they form one LoRA segment (and still do after pickling)."""

    a_offsets: tuple[int, ...]
    b_offsets: tuple[int, ...]
    ranks: tuple[int, ...]
    scales: tuple[float, ...]

    @classmethod
    def at(cls, start: int, layout: AdapterLayout) -> AdapterPlacement:
        return cls(tuple(start + o for o in layout.a_offsets), tuple(start + o for o in layout.b_offsets),
                   layout.ranks, layout.scales)


@dataclass(eq=False, slots=True)
class ResidentAdapter:
    """An adapter's place in the pool and its bookkeeping there."""

    adapter_id: str
    version: str
    start: int
    layout: AdapterLayout
    refcount: int = 0
    ready: bool = False  # the host -> pool copy has completed
    stale: bool = False  # replaced or deleted: freed when the last user releases it
    failed: bool = False  # the copy failed: freed then; whoever joined it is told, none releases it
    last_used: float = field(default_factory=time.monotonic)
    placement: AdapterPlacement = field(init=False)

    def __post_init__(self) -> None:
        self.placement = AdapterPlacement.at(self.start, self.layout)
