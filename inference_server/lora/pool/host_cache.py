"""Host tier of the adapter pool: staged adapters in one (pinned) host byte arena, LRU by bytes.

The arena is allocated once (pinned on GPU hosts, so a host-tier hit is one asynchronous
host-to-device copy with no allocation on the way); adapters are staged straight into
their range of it: by default the source's raw tensors, which the device lays out
(``device_packing``), or the packed pool layout itself. A GPU miss that hits this tier
costs one copy (and the device-side layout); a miss here goes to the adapter source.
Entries are keyed by adapter id and carry the version they were staged from, so an
invalidated id never serves stale bytes. An entry is leased while a copy reads
it and is never evicted or overwritten under a lease.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from loraplex.inference_server.lora.pool.device_packing import DevicePackPlan
from loraplex.inference_server.lora.pool.range_allocator import RangeAllocator
from loraplex.inference_server.lora.resident import AdapterLayout


@dataclass(eq=False, slots=True)
class PackedAdapter:
    adapter_id: str
    version: str
    flat: torch.Tensor  # 1-D: a range of the arena (or standalone when uncached)
    layout: AdapterLayout
    start: int = -1  # arena byte offset, -1 = not in the arena
    leases: int = 0
    plan: DevicePackPlan | None = None  # flat holds staged raw bytes (uint8); None: the packed pool layout
    epoch: int = 0  # the manager's invalidation count of this id when its files were read

    @property
    def num_bytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


ALIGN_BYTES = 64  # every range starts aligned for any dtype and for wide memcpy


class HostAdapterCache:
    def __init__(
        self,
        capacity_bytes: int,
        pin: bool = False,
        on_evict: Callable[[PackedAdapter], None] | None = None,
    ) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"host cache capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._arena = torch.empty(max(capacity_bytes, 1), dtype=torch.uint8, pin_memory=pin)
        self._alloc = RangeAllocator(self._arena.numel(), align=ALIGN_BYTES)
        self._entries: OrderedDict[str, PackedAdapter] = OrderedDict()  # LRU first
        self._lock = threading.Lock()
        self._on_evict = on_evict
        self.pinned = pin

    @property
    def used_bytes(self) -> int:
        return self._alloc.used

    def __len__(self) -> int:
        return len(self._entries)

    def lease(self, adapter_id: str) -> PackedAdapter | None:
        """The cached entry with a lease taken (``release`` it after the copy), or None."""
        with self._lock:
            entry = self._entries.get(adapter_id)
            if entry is not None:
                self._entries.move_to_end(adapter_id)
                entry.leases += 1
            return entry

    def release(self, entry: PackedAdapter) -> None:
        with self._lock:
            entry.leases -= 1
            if entry.leases == 0 and entry.start >= 0 and self._entries.get(entry.adapter_id) is not entry:
                self._alloc.free(entry.start)  # invalidated while leased: free now

    def reserve(self, numel: int, dtype: torch.dtype, zero: bool = True) -> tuple[torch.Tensor, int]:
        """A buffer of ``numel`` elements of ``dtype`` to stage into (zeroed unless ``zero`` is
        False): an arena range (evicting LRU unleased entries as needed), else a standalone
        tensor (start -1) that is not cached."""
        num_bytes = numel * dtype.itemsize
        evicted = []
        with self._lock:
            start = self._alloc.alloc(num_bytes)
            while start is None and self._evict_one(evicted):
                start = self._alloc.alloc(num_bytes)
        for victim in evicted:
            if self._on_evict is not None:
                self._on_evict(victim)
        if start is None:
            make = torch.zeros if zero else torch.empty
            return make(numel, dtype=dtype, pin_memory=self.pinned), -1
        buffer = self._arena[start : start + num_bytes].view(dtype)
        if zero:
            buffer.zero_()
        return buffer, start

    def abandon(self, start: int) -> None:
        """Give back a reserved range that will not be inserted (packing failed)."""
        if start >= 0:
            with self._lock:
                self._alloc.free(start)

    def _evict_one(self, evicted: list[PackedAdapter]) -> bool:
        for adapter_id, entry in self._entries.items():
            if entry.leases == 0:
                del self._entries[adapter_id]
                self._alloc.free(entry.start)
                evicted.append(entry)
                return True
        return False

    def insert(self, entry: PackedAdapter) -> PackedAdapter:
        """Publish a packed entry (replacing an older version) and return it leased."""
        with self._lock:
            old = self._entries.pop(entry.adapter_id, None)
            if old is not None and old.leases == 0:
                self._alloc.free(old.start)
            entry.leases += 1
            if entry.start >= 0:
                self._entries[entry.adapter_id] = entry
            return entry

    def versions(self) -> dict[str, str]:
        with self._lock:
            return {k: e.version for k, e in self._entries.items()}

    def invalidate(self, adapter_id: str) -> None:
        with self._lock:
            old = self._entries.pop(adapter_id, None)
            if old is not None and old.leases == 0:
                self._alloc.free(old.start)
