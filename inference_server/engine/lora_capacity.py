"""How many adapters the device pool holds at once: the ``max_lora`` that LoRA-affine routers
read (``vllm:lora_requests_info``), as plain arithmetic over the pool's size and the footprints
of the adapters it serves.

A router scores a replica "has room" while its running and waiting adapters number fewer than
``max_lora`` (the Gateway API Inference Extension's lora-affinity scorer), so ``max_lora`` must
be what the pool really holds, not the batch size: with a pool full of other adapters, a cold
adapter sent there evicts. Adapters of different ranks take different room (the pool pages
them in rank units), so the count is the pool's bytes over the footprint of the rank this
replica serves: the median footprint of the last ``HISTORY`` distinct adapters it held, so it
follows the rank mix as it changes (and a change of the pool's size at once). Before any
adapter was held, the footprint of a largest adapter (``--max-lora-rank`` on every projection)
stands in: a lower bound, never a promise the pool cannot keep.
"""

from __future__ import annotations

import statistics
import threading
from collections import OrderedDict
from collections.abc import Mapping

HISTORY = 64  # distinct adapters whose footprints make the served mix
_BLOCK_ALIGN = 64  # elements: the pool starts every A and B block aligned (at most this much padding each)


def largest_adapter_bytes(projection_shapes: Mapping[str, tuple[int, int]], num_layers: int, max_rank: int,
                          element_size: int) -> int:
    """Pool bytes of an adapter of rank ``max_rank`` on every projection (its A and B blocks
    padded to their alignment): the most one adapter can take."""
    elements = sum(num_layers * max_rank * (fan_in + fan_out) + 2 * _BLOCK_ALIGN
                   for fan_in, fan_out in projection_shapes.values())
    return elements * element_size


class LoraCapacity:
    """Footprints of the adapters held lately, and the count the pool holds at once."""

    def __init__(self, largest_adapter_bytes: int) -> None:
        if largest_adapter_bytes < 1:
            raise ValueError(f"largest_adapter_bytes must be >= 1, got {largest_adapter_bytes}")
        self._largest = largest_adapter_bytes
        self._seen: OrderedDict[str, int] = OrderedDict()  # adapter id -> its pool bytes, newest last
        self._lock = threading.Lock()

    def note(self, footprints: Mapping[str, int]) -> None:
        """Record the adapters held now ({adapter id: pool bytes}), the newest mix first."""
        with self._lock:
            for adapter_id, size in footprints.items():
                self._seen.pop(adapter_id, None)
                self._seen[adapter_id] = size
            while len(self._seen) > HISTORY:
                self._seen.popitem(last=False)

    def served_footprint(self) -> int:
        """Pool bytes of an adapter of the served rank (the median of the recent mix)."""
        with self._lock:
            sizes = list(self._seen.values())
        return int(statistics.median_high(sizes)) if sizes else self._largest

    def max_lora(self, pool_bytes: int) -> int:
        """Distinct adapters of the served rank the pool holds at once (at least 1: a pool that
        holds none refuses such adapters outright, which no router can route around)."""
        return max(1, pool_bytes // self.served_footprint())
