"""An adapter resident in the GPU pool, as the per-step tables see it: where each
projection's A and B start, its ranks and scales. The pool (pool/) makes these; the batch
tables (batch.py) read them."""

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


@dataclass(eq=False, slots=True)
class ResidentAdapter:
    """An adapter's place in the pool; the per-step tables are built from these."""

    adapter_id: str
    version: str
    start: int
    layout: AdapterLayout
    refcount: int = 0
    ready: bool = False  # the host -> pool copy has completed
    stale: bool = False  # replaced or deleted: freed when the last user releases it
    last_used: float = field(default_factory=time.monotonic)

    @property
    def a_offsets(self) -> list[int]:
        return [self.start + o for o in self.layout.a_offsets]

    @property
    def b_offsets(self) -> list[int]:
        return [self.start + o for o in self.layout.b_offsets]
