"""How the pool packs adapters when its host tier must hold them laid out, not raw.

By default the host tier holds an adapter's raw tensors and the device lays them out
(device_packing.py). Tensor parallelism (inference_server/parallel/adapters.py) instead packs
every rank's shard on the host, lays this process's pool out for one rank's shard, and hands
the other ranks theirs when an adapter is placed: it gives the pool a ``HostPacking``.
"""

from __future__ import annotations

from typing import Protocol

import torch

from loraplex.adapter_store.format.peft_format import AdapterSpec
from loraplex.inference_server.lora.pool.host_cache import PackedAdapter
from loraplex.inference_server.lora.resident import AdapterLayout


class HostPacking(Protocol):
    def layout(self, spec: AdapterSpec) -> AdapterLayout:
        """Where the adapter's A/B blocks go in this process's pool."""
        ...

    def host_elements(self, layout: AdapterLayout) -> int:
        """Host-tier elements (the pool's dtype) one packed adapter takes."""
        ...

    def pack(self, spec: AdapterSpec, tensors: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """Pack ``tensors`` into ``out`` (a host-tier buffer); the part this process's pool takes first."""
        ...

    def placed(self, start: int, packed: PackedAdapter) -> None:
        """The adapter is being copied into the pool at ``start`` (called before it is marked
        ready, so whatever this queues reaches its peers before a step can read it)."""
        ...
