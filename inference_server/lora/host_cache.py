"""Host tier of the adapter pool: packed adapters in (pinned) host memory, LRU by bytes.

A GPU miss that hits this tier costs one host-to-device copy; a miss here goes to the
adapter source (store or local directory). Entries are keyed by adapter id and carry the
version they were packed from, so an invalidated id never serves stale bytes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from inference_server.lora.packing import AdapterLayout


@dataclass(frozen=True, slots=True)
class PackedAdapter:
    adapter_id: str
    version: str
    flat: torch.Tensor  # 1-D, model dtype, pinned when a GPU is used
    layout: AdapterLayout

    @property
    def num_bytes(self) -> int:
        return self.flat.numel() * self.flat.element_size()


class HostAdapterCache:
    def __init__(self, capacity_bytes: int, on_evict: Callable[[PackedAdapter], None] | None = None) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"host cache capacity must be >= 0 bytes, got {capacity_bytes}")
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[str, PackedAdapter] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self._on_evict = on_evict

    @property
    def used_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, adapter_id: str) -> PackedAdapter | None:
        with self._lock:
            entry = self._entries.get(adapter_id)
            if entry is not None:
                self._entries.move_to_end(adapter_id)
            return entry

    def put(self, entry: PackedAdapter) -> None:
        """Insert (replacing any older version), then evict LRU entries over the budget.
        An entry larger than the whole budget is not kept."""
        evicted = []
        with self._lock:
            old = self._entries.pop(entry.adapter_id, None)
            if old is not None:
                self._bytes -= old.num_bytes
            if entry.num_bytes <= self.capacity_bytes:
                self._entries[entry.adapter_id] = entry
                self._bytes += entry.num_bytes
            while self._bytes > self.capacity_bytes:
                _, victim = self._entries.popitem(last=False)
                self._bytes -= victim.num_bytes
                evicted.append(victim)
        for victim in evicted:
            if self._on_evict is not None:
                self._on_evict(victim)

    def invalidate(self, adapter_id: str) -> None:
        with self._lock:
            old = self._entries.pop(adapter_id, None)
            if old is not None:
                self._bytes -= old.num_bytes
