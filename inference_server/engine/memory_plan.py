"""How a GPU's memory is shared at start: weights (loaded first), then what a running engine needs
beyond its caches (the reserve, measured by engine/profile_run.py), then the KV cache and the adapter
pool. Sizes given by flag are taken first; fractions share what is left. A plan that does not fit is
refused at start, naming the flags and the figures, so no forward runs out of memory later.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.inference_server.engine.config import EngineConfig

GiB = 1 << 30


def gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB"


@dataclass(frozen=True, slots=True)
class Reserve:
    """Device memory a running engine needs besides its weights, KV cache and adapter pool."""

    buffers: int  # the runner's own (decode workspace, LoRA tables, sampler state): measured
    activations: int  # the peak of the largest eager steps (a full prefill chunk, a full decode): measured
    graphs: int  # CUDA graphs' private pool: their largest step's activations and every graph's logits
    slack: int  # cuBLAS workspaces, allocator rounding, kernels loaded later

    @property
    def total(self) -> int:
        return self.buffers + self.activations + self.graphs + self.slack

    def describe(self) -> str:
        return (f"{gib(self.total)} (runner buffers {gib(self.buffers)}, activations {gib(self.activations)}, "
                f"CUDA graphs {gib(self.graphs)}, slack {gib(self.slack)})")


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    num_kv_blocks: int
    kv_bytes: int
    pool_bytes: int
    reserve: Reserve | None  # None on the CPU (its sizes are the flags')


UNMEASURED_SHARE = 0.1  # of the free memory, reserved where no profile run can measure it


def unmeasured_reserve(free: int) -> Reserve:
    """The reserve of a tensor-parallel rank, which cannot run a profile step alone: a tenth of
    what is free after its shard of the weights, at least 1 GiB."""
    return Reserve(0, 0, 0, max(GiB, int(free * UNMEASURED_SHARE)))


def kv_block_bytes(config: EngineConfig, num_layers: int, num_kv_heads: int, head_dim: int, elem: int) -> int:
    return 2 * num_layers * config.block_size * num_kv_heads * head_dim * elem


def plan_memory(config: EngineConfig, block_bytes: int, free: int, reserve: Reserve) -> MemoryPlan:
    """Share ``free`` (bytes free on the device after the weights) between the reserve, the KV
    cache (``--num-kv-blocks``, else ``kv_cache_memory_fraction`` of what the reserve and a pool
    given in bytes leave) and the adapter pool (``--adapter-pool-bytes``, else
    ``adapter_pool_memory_fraction`` of what the KV cache leaves). Raises ValueError naming the
    flags when the sizes asked for do not fit."""
    available = free - reserve.total
    if available <= 0:
        raise ValueError(f"the GPU has {gib(free)} free after the model's weights, less than the "
                         f"{reserve.describe()} that steps of --max-num-seqs {config.max_num_seqs} and "
                         f"--max-num-batched-tokens {config.max_num_batched_tokens} need; lower them")
    fixed_pool = config.adapter_pool_bytes if config.adapter_pool_memory_fraction is None else None
    if config.num_kv_blocks is not None:
        blocks = config.num_kv_blocks
    else:
        blocks = int((available - (fixed_pool or 0)) * config.kv_cache_memory_fraction) // block_bytes
        if blocks < 1:
            raise ValueError(f"no room for a KV cache: {gib(free)} free after the weights, {reserve.describe()} "
                             f"reserved, --adapter-pool-bytes {gib(fixed_pool or 0)}; lower --adapter-pool-bytes")
    kv = blocks * block_bytes
    pool = fixed_pool if fixed_pool is not None else int((available - kv) * config.adapter_pool_memory_fraction)
    if kv + pool > available or pool <= 0:
        raise ValueError(
            f"the KV cache ({blocks} blocks, {gib(kv)}) and the adapter pool ({gib(pool)}) do not fit the "
            f"{gib(available)} left of {gib(free)} free after the weights and {reserve.describe()} reserved for "
            f"steps at --max-num-seqs {config.max_num_seqs}: lower --num-kv-blocks or --adapter-pool-bytes, or "
            f"leave them to the memory fractions")
    return MemoryPlan(blocks, kv, pool, reserve)
