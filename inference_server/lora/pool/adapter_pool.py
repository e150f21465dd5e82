"""Adapter manager: residency of adapters in the GPU pool, over a host tier and a source.

Tiers: GPU pool (one flat tensor allocated once; LRU over adapters no running request uses;
reference counted) <- host tier (raw tensors, pinned, LRU by bytes) <- adapter source (store or
local directory). ``acquire`` runs on a loader thread, never on the step loop:

1. fetch + validate + stage into the host tier: one memcpy of the source's raw tensors
   (this is the prefetch: it happens at once, even when the pool is full);
2. take a place in the pool. Under pressure, acquisitions are served strictly in arrival
   order, and a request for an already resident adapter queues behind earlier waiters
   too, so resident adapters drain and rotate out: no waiter starves. A waiter waits as long
   as its caller does (running requests release their adapters as they finish; a caller that
   leaves cancels its wait), so a cold adapter is queued, never refused, while running
   requests pin every place; an ``acquire_timeout_s`` bounds the wait where one is wanted;
3. copy host -> device on a side stream and lay the adapter out in its pool range there
   (``PoolCopier``, ``device_packing``); the request is scheduled only once that has
   completed, while the engine keeps decoding everyone else.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque

import torch

from loraplex.adapter_store.errors import AdapterValidationError, ResourceExhaustedError
from loraplex.adapter_store.format.files import AdapterSource
from loraplex.adapter_store.format.peft_format import WEIGHTS_FILE, AdapterSpec, parse_adapter_files
from loraplex.inference_server.lora.pool.copier import PoolCopier
from loraplex.inference_server.lora.pool.device_packing import plan_device_pack, stage
from loraplex.inference_server.lora.pool.host_cache import HostAdapterCache, PackedAdapter
from loraplex.inference_server.lora.pool.host_packing import HostPacking
from loraplex.inference_server.lora.pool.packing import plan_layout
from loraplex.inference_server.lora.pool.pool_stats import PoolMetrics, PoolStats
from loraplex.inference_server.lora.pool.pool_writes import PoolWrites, WriteListener
from loraplex.inference_server.lora.pool.range_allocator import RangeAllocator
from loraplex.inference_server.lora.pool.tensor_views import tensor_views
from loraplex.inference_server.lora.resident import AdapterLayout, ResidentAdapter
from loraplex.inference_server.model.config import ModelConfig

log = logging.getLogger(__name__)


class AcquireCancelled(Exception):
    """An acquire's caller left while it waited for pool space (``AdapterPool.cancel_wait``)."""


class AdapterPool:
    """Owns the adapter pool tensor and its bookkeeping (thread-safe)."""

    def __init__(
        self,
        source: AdapterSource,
        model_config: ModelConfig,
        pool_elements: int,
        dtype: torch.dtype,
        device: torch.device | str,
        acquire_timeout_s: float | None = None,
        host_cache_bytes: int = 1 << 30,
        host_packing: HostPacking | None = None,
    ) -> None:
        self.source = source
        self._packing = host_packing
        self.config = model_config
        self.dtype = dtype
        self.pool = torch.zeros(pool_elements, dtype=dtype, device=device)
        self._alloc = RangeAllocator(pool_elements)
        self._copier = PoolCopier(self.pool.device)
        self._writes = PoolWrites(self.pool, self._copier)
        self.metrics = PoolMetrics()
        self.host = HostAdapterCache(host_cache_bytes, pin=self._copier.wants_pinned,
                                     on_evict=lambda _: self.metrics.count("host_evictions"))
        self._resident: OrderedDict[str, ResidentAdapter] = OrderedDict()  # LRU first
        self._queue: deque[object] = deque()  # tickets of acquisitions waiting for the pool
        # invalidations so far, by adapter id: what was read from the source before the latest one
        # (a delete or a re-upload racing a cold load) is never placed or served
        self._epochs: dict[str, int] = {}
        self._cond = threading.Condition()
        self._timeout = acquire_timeout_s

    @property
    def counts_pool_writes(self) -> bool:
        """Whether the pool has a write count (``_version``; not for inference-mode tensors)."""
        return self._writes.counted

    def add_write_listener(self, listener: WriteListener) -> None:
        """Call ``listener(pool, start, end, before, after)`` after each adapter copied into the
        pool (elements [start, end); the pool's ``_version`` before and after that copy alone)."""
        self._writes.add_listener(listener)

    # -- acquire / release -----------------------------------------------------------------
    def try_acquire_resident(self, adapter_id: str) -> ResidentAdapter | None:
        """Non-blocking fast path (event loop): a reference if resident and nobody waits."""
        with self._cond:
            ra = self._resident.get(adapter_id)
            if ra is None or not ra.ready or self._queue:
                return None
            self.metrics.count("gpu_hits")
            return self._take(ra)

    def acquire(self, adapter_id: str, cancel: threading.Event | None = None) -> ResidentAdapter:
        """Make ``adapter_id`` resident and take a reference (blocking; a loader thread).

        Waits for pool space until ``cancel`` is set (through ``cancel_wait``: AcquireCancelled)
        or a configured acquire timeout runs out (ResourceExhaustedError). Raises
        AdapterNotFoundError or AdapterValidationError for an adapter it cannot serve."""
        started = time.monotonic()
        deadline = None if self._timeout is None else started + self._timeout
        leased: list[PackedAdapter] = []
        try:
            packed = self._host_tier(adapter_id, leased)
            ra, to_copy = self._place(packed, deadline, cancel, leased)
            if to_copy is not None:
                self._copy_in(ra, to_copy)
                self.metrics.observe_load(time.monotonic() - started)
        finally:
            for entry in leased:
                self.host.release(entry)
        return self._wait_ready(ra)

    def prefetch(self, adapter_id: str) -> None:
        """Fetch, check and stage ``adapter_id`` in the host tier without taking a pool place
        (acquire's first step): a later acquire then costs the host -> GPU copy. Raises as
        acquire does for an unknown or invalid adapter (blocking; not on the step loop)."""
        leased: list[PackedAdapter] = []
        try:
            self._host_tier(adapter_id, leased)
        finally:
            for entry in leased:
                self.host.release(entry)

    def cancel_wait(self, cancel: threading.Event) -> None:
        """Set ``cancel`` (an ``acquire``'s) and wake the waiters: that acquire, if still waiting
        for pool space, gives up its turn and raises AcquireCancelled."""
        cancel.set()
        with self._cond:
            self._cond.notify_all()

    def release(self, ra: ResidentAdapter) -> None:
        with self._cond:
            ra.refcount -= 1
            if ra.refcount == 0 and ra.stale:
                self._alloc.free(ra.start)
            self._cond.notify_all()

    def _take(self, ra: ResidentAdapter) -> ResidentAdapter:
        ra.refcount += 1
        ra.last_used = time.monotonic()
        if not ra.stale:
            self._resident.move_to_end(ra.adapter_id)
        return ra

    # -- tiers -----------------------------------------------------------------------------
    def _host_tier(self, adapter_id: str, leased: list[PackedAdapter]) -> PackedAdapter:
        """The packed adapter from the host tier (leased), fetched and packed on a miss.
        Returns an empty placeholder when the adapter is resident and not in the host tier."""
        packed = self.host.lease(adapter_id)
        if packed is not None:
            self.metrics.count("host_hits")
            leased.append(packed)
            return packed
        with self._cond:
            ra = self._resident.get(adapter_id)
            epoch = self._epochs.get(adapter_id, 0)
        if ra is not None:  # resident but evicted from the host tier: no fetch needed
            return PackedAdapter(adapter_id, ra.version, torch.empty(0, dtype=self.dtype), ra.layout, epoch=epoch)
        self.metrics.count("source_fetches")
        files = self.source.resolve(adapter_id)
        spec = files.spec  # the base model decides what fits: checked again unless against this one
        if spec.checked_base != self.config:  # (its patterns as the source decided them)
            spec = parse_adapter_files(files.files, self.config, decided=spec.pattern_values)
        layout = self.fitting_layout(adapter_id, spec)
        staged = self._stage(adapter_id, files.info.version, spec, files.files[WEIGHTS_FILE], layout)
        staged.epoch = epoch
        packed = self.host.insert(staged)
        leased.append(packed)
        return packed

    def fitting_layout(self, adapter_id: str, spec: AdapterSpec) -> AdapterLayout:
        """The adapter's place in the pool; AdapterValidationError when it is larger than the whole
        pool: never loadable on this server, so not a "retry later" (429)."""
        layout = self._pool_layout(spec)
        if layout.num_elements > self._alloc.capacity:
            elem = self.dtype.itemsize
            raise AdapterValidationError(
                f"adapter {adapter_id!r} (rank {spec.rank}) needs {layout.num_elements * elem} bytes of the adapter "
                f"pool, which holds {self._alloc.capacity * elem} on this server: it cannot be served here (raise "
                "--adapter-pool-bytes, or upload a lower rank)")
        return layout

    def _pool_layout(self, spec: AdapterSpec) -> AdapterLayout:
        """Where the adapter's A/B blocks go in this process's pool."""
        return plan_layout(spec, self.config) if self._packing is None else self._packing.layout(spec)

    def _stage(
        self, adapter_id: str, version: str, spec: AdapterSpec, weights: bytes, layout: AdapterLayout
    ) -> PackedAdapter:
        """The adapter in a host-tier buffer: its raw tensors (one memcpy) and the plan that
        lays them out on the device; with a HostPacking (host_packing.py), packed on the host instead."""
        if self._packing is not None:
            return self._stage_packed(self._packing, adapter_id, version, spec, weights, layout)
        plan, table = plan_device_pack(spec, weights, layout, self.config)
        buffer, start = self.host.reserve(plan.staged_bytes, torch.uint8, zero=False)
        try:
            stage(weights, plan, table, buffer)
        except BaseException:
            self.host.abandon(start)
            raise
        return PackedAdapter(adapter_id, version, buffer, layout, start, plan=plan)

    def _stage_packed(
        self, packing: HostPacking,
        adapter_id: str, version: str, spec: AdapterSpec, weights: bytes, layout: AdapterLayout,
    ) -> PackedAdapter:
        buffer, start = self.host.reserve(packing.host_elements(layout), self.dtype)
        try:
            flat = packing.pack(spec, tensor_views(weights), buffer)  # header checked: views cannot overrun
        except BaseException:
            self.host.abandon(start)
            raise
        return PackedAdapter(adapter_id, version, flat, layout, start)

    def _place(
        self, packed: PackedAdapter, deadline: float | None, cancel: threading.Event | None,
        leased: list[PackedAdapter],
    ) -> tuple[ResidentAdapter, PackedAdapter | None]:
        """FIFO under pressure: wait for our turn, then reuse a resident copy or reserve space.
        Returns the reference and, when a copy into the pool is needed, what to copy."""
        ticket = object()
        with self._cond:
            self._queue.append(ticket)
            try:
                while True:
                    if cancel is not None and cancel.is_set():
                        raise AcquireCancelled(f"the wait for {packed.adapter_id!r} was cancelled")
                    if self._queue[0] is ticket:
                        placed = self._place_now(packed, leased)
                        if placed is not None:
                            return placed
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise ResourceExhaustedError(
                            f"adapter pool full of in-use adapters; {packed.adapter_id!r} waited "
                            f"{self._timeout:.0f}s (raise the pool size or lower the batch size)"
                        )
                    self._cond.wait(timeout=left)
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()

    def _place_now(
        self, packed: PackedAdapter, leased: list[PackedAdapter]
    ) -> tuple[ResidentAdapter, PackedAdapter | None] | None:
        ra = self._resident.get(packed.adapter_id)
        if ra is not None:
            self.metrics.count("gpu_hits" if ra.ready else "gpu_joins")
            return self._take(ra), None
        if packed.epoch != self._epochs.get(packed.adapter_id, 0):  # read before a delete or re-upload
            self.metrics.count("stale_fetches")
            self.host.invalidate(packed.adapter_id)  # (it may have reached the host tier after the invalidation)
            packed = self._host_tier_locked_refetch(packed.adapter_id, leased)
        elif packed.flat.numel() == 0:  # the resident copy vanished meanwhile: refetch
            packed = self._host_tier_locked_refetch(packed.adapter_id, leased)
        start = self._reserve(packed.layout.num_elements)
        if start is None:
            return None
        self.metrics.count("gpu_loads")
        ra = ResidentAdapter(packed.adapter_id, packed.version, start, packed.layout)
        self._resident[packed.adapter_id] = ra
        return self._take(ra), packed

    def _host_tier_locked_refetch(self, adapter_id: str, leased: list[PackedAdapter]) -> PackedAdapter:
        self._cond.release()
        try:
            return self._host_tier(adapter_id, leased)
        finally:
            self._cond.acquire()

    def _reserve(self, size: int) -> int | None:
        while True:
            start = self._alloc.alloc(size)
            if start is not None or not self._evict_one():
                return start

    def _evict_one(self) -> bool:
        for adapter_id, ra in self._resident.items():
            if ra.refcount == 0 and ra.ready:
                del self._resident[adapter_id]
                self._alloc.free(ra.start)
                self.metrics.count("gpu_evictions")
                log.debug("evicted adapter %s from the pool", adapter_id)
                return True
        return False

    def _copy_in(self, ra: ResidentAdapter, packed: PackedAdapter) -> None:
        try:
            if self._packing is not None:
                self._packing.placed(ra.start, packed)
            self._writes.write(ra.start, packed)
        except BaseException:
            with self._cond:  # its place is freed here, once: a failed copy is never released
                ra.failed = True
                if self._resident.get(ra.adapter_id) is ra:  # (invalidated meanwhile: a newer copy may be there)
                    del self._resident[ra.adapter_id]
                self._alloc.free(ra.start)
                self._cond.notify_all()
            raise
        with self._cond:
            ra.ready = True
            self._cond.notify_all()

    def _wait_ready(self, ra: ResidentAdapter) -> ResidentAdapter:
        with self._cond:
            while not ra.ready:
                if ra.failed:
                    ra.refcount -= 1
                    raise ResourceExhaustedError(f"loading adapter {ra.adapter_id!r} failed; retry")
                self._cond.wait(timeout=1.0)
            return ra

    # -- invalidation and visibility --------------------------------------------------------
    def invalidate(self, adapter_id: str) -> None:
        """Drop a replaced or deleted adapter from every tier; running requests finish on
        the old copy, which is freed when they release it. A load that read the adapter's files
        before this call fetches them again before it takes a pool place."""
        with self._cond:
            self._epochs[adapter_id] = self._epochs.get(adapter_id, 0) + 1
        self.host.invalidate(adapter_id)
        with self._cond:
            ra = self._resident.pop(adapter_id, None)
            if ra is None:
                return
            self.metrics.count("invalidations")
            if ra.refcount == 0:
                self._alloc.free(ra.start)
            else:
                ra.stale = True
            self._cond.notify_all()

    def held_versions(self) -> dict[str, str]:
        """{adapter id: version} of every adapter held in the pool or the host tier."""
        held = self.host.versions()
        with self._cond:
            held.update((k, ra.version) for k, ra in self._resident.items())
        return held

    def resident_ids(self) -> list[str]:
        with self._cond:
            return [k for k, ra in self._resident.items() if ra.ready]

    def resident_footprints(self) -> dict[str, int]:
        """{adapter id: its bytes in the pool} of every ready resident adapter."""
        elem = self.pool.element_size()
        with self._cond:
            return {k: ra.layout.num_elements * elem for k, ra in self._resident.items() if ra.ready}

    def stats(self) -> PoolStats:
        elem = self.pool.element_size()
        with self._cond:
            return PoolStats(
                resident=sum(1 for r in self._resident.values() if r.ready),
                in_use=sum(1 for r in self._resident.values() if r.refcount),
                waiting=len(self._queue),
                used_bytes=self._alloc.used * elem,
                capacity_bytes=self._alloc.capacity * elem,
                host_entries=len(self.host),
                host_bytes=self.host.used_bytes,
                counters=self.metrics.snapshot(),
            )
