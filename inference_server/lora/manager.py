"""Adapter manager: which adapters are resident in the pool, reference counts, LRU eviction.

The pool is one flat tensor allocated once (``pool_elements`` of the model dtype). An
adapter is resolved from its ``AdapterSource``, validated against the base model, packed
(see packing.py) and copied into a free range. Adapters in use by a running request are
never evicted; when the pool is full of in-use adapters, ``acquire`` waits (bounded by a
timeout) instead of failing at once. ``acquire`` runs in a worker thread, never on the
engine's step loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from safetensors.torch import load as load_safetensors

from inference_server.errors import AdapterValidationError, ResourceExhaustedError
from inference_server.lora.packing import AdapterLayout, pack_adapter, plan_layout
from inference_server.lora.peft_format import WEIGHTS_FILE, parse_adapter_files
from inference_server.lora.range_allocator import RangeAllocator
from inference_server.lora.source import AdapterSource
from inference_server.model.config import ModelConfig

log = logging.getLogger(__name__)


@dataclass(eq=False, slots=True)
class ResidentAdapter:
    """An adapter's place in the pool; the per-step tables are built from these."""

    adapter_id: str
    version: str
    start: int
    layout: AdapterLayout
    refcount: int = 0
    stale: bool = False  # replaced or deleted: freed when the last user releases it
    last_used: float = field(default_factory=time.monotonic)

    @property
    def a_offsets(self) -> list[int]:
        return [self.start + o for o in self.layout.a_offsets]

    @property
    def b_offsets(self) -> list[int]:
        return [self.start + o for o in self.layout.b_offsets]


@dataclass(frozen=True, slots=True)
class PoolStats:
    resident: int
    in_use: int
    used_elements: int
    capacity_elements: int
    loads: int
    evictions: int


class AdapterManager:
    """Owns the adapter pool tensor and its bookkeeping (thread-safe)."""

    def __init__(
        self,
        source: AdapterSource,
        model_config: ModelConfig,
        pool_elements: int,
        dtype: torch.dtype,
        device: torch.device | str,
        acquire_timeout_s: float = 60.0,
    ) -> None:
        self.source = source
        self.config = model_config
        self.dtype = dtype
        self.pool = torch.zeros(pool_elements, dtype=dtype, device=device)
        self._alloc = RangeAllocator(pool_elements)
        self._resident: OrderedDict[str, ResidentAdapter] = OrderedDict()  # LRU first
        self._loading: set[str] = set()
        self._cond = threading.Condition()
        self._timeout = acquire_timeout_s
        self._loads = 0
        self._evictions = 0

    def acquire(self, adapter_id: str) -> ResidentAdapter:
        """Make ``adapter_id`` resident and take a reference. Raises AdapterNotFoundError,
        AdapterValidationError, or ResourceExhaustedError after the bounded wait."""
        with self._cond:
            while adapter_id in self._loading:
                self._cond.wait()
            hit = self._resident.get(adapter_id)
            if hit is not None:
                return self._take(hit)
            self._loading.add(adapter_id)
        try:
            return self._load(adapter_id)
        finally:
            with self._cond:
                self._loading.discard(adapter_id)
                self._cond.notify_all()

    def _take(self, ra: ResidentAdapter) -> ResidentAdapter:
        ra.refcount += 1
        ra.last_used = time.monotonic()
        self._resident.move_to_end(ra.adapter_id)
        return ra

    def _load(self, adapter_id: str) -> ResidentAdapter:
        files = self.source.resolve(adapter_id)
        spec = parse_adapter_files(files.files, self.config)  # the base model decides what fits
        layout = plan_layout(spec, self.config)
        if layout.num_elements > self._alloc.capacity:
            raise ResourceExhaustedError(
                f"adapter {adapter_id!r} needs {layout.num_elements} pool elements; the pool holds "
                f"{self._alloc.capacity} (raise the adapter pool size)"
            )
        try:
            tensors = load_safetensors(files.files[WEIGHTS_FILE])
        except Exception as e:  # safetensors raises its own error types for corrupt data
            raise AdapterValidationError(f"adapter {adapter_id!r}: cannot read adapter_model.safetensors ({e})") from e
        flat, layout = pack_adapter(spec, tensors, self.config, self.dtype)
        start = self._reserve(adapter_id, layout.num_elements)
        self.pool[start : start + flat.numel()].copy_(flat)
        ra = ResidentAdapter(adapter_id, files.info.version, start, layout)
        with self._cond:
            self._resident[adapter_id] = ra
            self._loads += 1
            return self._take(ra)

    def _reserve(self, adapter_id: str, size: int) -> int:
        deadline = time.monotonic() + self._timeout
        with self._cond:
            while True:
                start = self._alloc.alloc(size)
                if start is not None:
                    return start
                if self._evict_one():
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ResourceExhaustedError(
                        f"adapter pool full of in-use adapters; {adapter_id!r} waited {self._timeout:.0f}s"
                    )
                self._cond.wait(timeout=left)

    def _evict_one(self) -> bool:
        for adapter_id, ra in self._resident.items():
            if ra.refcount == 0:
                del self._resident[adapter_id]
                self._alloc.free(ra.start)
                self._evictions += 1
                log.debug("evicted adapter %s", adapter_id)
                return True
        return False

    def release(self, ra: ResidentAdapter) -> None:
        with self._cond:
            ra.refcount -= 1
            if ra.refcount == 0 and ra.stale:
                self._alloc.free(ra.start)
            self._cond.notify_all()

    def invalidate(self, adapter_id: str) -> None:
        """Drop a replaced or deleted adapter; running requests finish on the old copy."""
        with self._cond:
            ra = self._resident.pop(adapter_id, None)
            if ra is None:
                return
            if ra.refcount == 0:
                self._alloc.free(ra.start)
            else:
                ra.stale = True
            self._cond.notify_all()

    def resident_ids(self) -> list[str]:
        with self._cond:
            return list(self._resident)

    def stats(self) -> PoolStats:
        with self._cond:
            return PoolStats(
                resident=len(self._resident),
                in_use=sum(1 for r in self._resident.values() if r.refcount),
                used_elements=self._alloc.used,
                capacity_elements=self._alloc.capacity,
                loads=self._loads,
                evictions=self._evictions,
            )
