"""Rank 0's adapter packing: the pool's usual residency bookkeeping, with every rank's shard packed.

The bookkeeping (LRU, reference counts, FIFO admission, host tier) stays on rank 0 only.
The host tier holds every rank's packed shard one after the other; rank 0 copies its own
into its pool as usual. Each placement is also queued as a ``ShardLoad`` (the workers'
shards copied out of the host tier, so a later eviction there cannot overwrite them); the
runner's peers (peers.py) send the queue with the next step and scatters each worker its shard, which the
worker copies to the same offset of its own pool before running that step's forward.
Placements are queued before the adapter is marked ready, and a request is scheduled only
after that, so a worker always has an adapter before the first step that reads it. Offsets
are the same on every rank because every rank's shard has the same layout.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from loraplex.adapter_store.format.peft_format import AdapterSpec
from loraplex.inference_server.lora.pool.host_cache import PackedAdapter
from loraplex.inference_server.lora.resident import AdapterLayout
from loraplex.inference_server.model.config import ModelConfig
from loraplex.inference_server.parallel.lora import pack_shards, shard_layout


@dataclass(frozen=True, slots=True)
class ShardLoad:
    """Copy each worker's shard into its pool at ``start`` (rank r gets shards[r - 1])."""

    start: int
    shards: torch.Tensor  # [world_size - 1, n] on the CPU

    @property
    def numel(self) -> int:
        return self.shards.shape[1]


class TensorParallelPacking:
    """The pool's HostPacking (lora/pool/host_packing.py) on rank 0 of ``world_size`` ranks: every
    rank's shard packed in the host tier, this rank's pool laid out for one shard, and each
    placement queued for the workers (``take_loads``)."""

    def __init__(self, full_config: ModelConfig, world_size: int) -> None:
        self.world_size = world_size
        self._full_config = full_config
        self._loads: list[ShardLoad] = []
        self._loads_lock = threading.Lock()

    def layout(self, spec: AdapterSpec) -> AdapterLayout:
        return shard_layout(spec, self._full_config, self.world_size)

    def host_elements(self, layout: AdapterLayout) -> int:
        return self.world_size * layout.num_elements

    def pack(self, spec: AdapterSpec, tensors: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        return pack_shards(spec, tensors, self._full_config, self.world_size, out.dtype, out=out)[0]

    def placed(self, start: int, packed: PackedAdapter) -> None:
        n = packed.layout.num_elements
        if self.world_size > 1:
            shards = packed.flat[n : self.world_size * n].view(self.world_size - 1, n).clone()
            with self._loads_lock:
                self._loads.append(ShardLoad(start, shards))

    def take_loads(self) -> list[ShardLoad]:
        """The placements not yet sent to the workers, oldest first (the step loop calls it)."""
        with self._loads_lock:
            loads, self._loads = self._loads, []
        return loads
