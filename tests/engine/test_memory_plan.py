"""How the GPU's memory is shared at start (engine/memory_plan.py): the reserve the profile run
measured comes first, sizes given by flag next, fractions share the rest, and sizes that do not
fit are refused at start naming the flags, instead of a forward running out of memory later.
The profile run itself is GPU code (tests/gpu/test_memory_plan_gpu.py)."""

from __future__ import annotations

import pytest

from loraplex.inference_server.engine.config import EngineConfig
from loraplex.inference_server.engine.memory_plan import GiB, Reserve, kv_block_bytes, plan_memory, unmeasured_reserve

MiB = 1 << 20
# Llama-7B in bfloat16: 32 layers, 32 KV heads of 128, 16-token blocks (8 MiB a block)
BLOCK = kv_block_bytes(EngineConfig(), 32, 32, 128, 2)
RESERVE = Reserve(buffers=300 * MiB, activations=1 * GiB, graphs=500 * MiB, slack=1600 * MiB)
ADAPTER_7B_R16 = 80 * 10**6  # q, k, v, o, gate, up, down at rank 16


def _gpu(**kw) -> EngineConfig:
    return EngineConfig(device="cuda", dtype="bfloat16", **{"adapter_pool_memory_fraction": 0.5, **kw})


def test_fractions_share_what_the_reserve_leaves() -> None:
    free = 66 * GiB
    plan = plan_memory(_gpu(), BLOCK, free, RESERVE)
    available = free - RESERVE.total
    assert plan.num_kv_blocks == int(available * 0.6) // BLOCK
    assert plan.pool_bytes == int((available - plan.kv_bytes) * 0.5)
    assert plan.kv_bytes + plan.pool_bytes + RESERVE.total <= free


def test_a_pool_given_in_bytes_is_taken_before_the_kv_fraction() -> None:
    """The OOM of the batch-256 bench on an H100: a pool for 264 adapters of a 7B shape beside a
    KV cache of 0.7 of the free memory. The KV fraction now shares what the pool leaves."""
    free = 66 * GiB
    pool = 264 * ADAPTER_7B_R16
    plan = plan_memory(_gpu(adapter_pool_bytes=pool, adapter_pool_memory_fraction=None, kv_cache_memory_fraction=0.7),
                       BLOCK, free, RESERVE)
    assert plan.pool_bytes == pool
    assert plan.num_kv_blocks == int((free - RESERVE.total - pool) * 0.7) // BLOCK
    assert plan.kv_bytes + plan.pool_bytes + RESERVE.total <= free


def test_sizes_that_do_not_fit_are_refused_naming_the_flags() -> None:
    free = 66 * GiB
    with pytest.raises(ValueError, match=r"--num-kv-blocks or --adapter-pool-bytes") as err:
        plan_memory(_gpu(num_kv_blocks=6000, adapter_pool_bytes=21 * GiB, adapter_pool_memory_fraction=None),
                    BLOCK, free, RESERVE)
    assert "6000 blocks, 46.88 GiB" in str(err.value) and "21.00 GiB" in str(err.value)
    with pytest.raises(ValueError, match="lower --adapter-pool-bytes"):
        plan_memory(_gpu(adapter_pool_bytes=70 * GiB, adapter_pool_memory_fraction=None), BLOCK, free, RESERVE)


def test_a_kv_cache_given_in_blocks_leaves_the_pool_its_fraction() -> None:
    free = 40 * GiB
    plan = plan_memory(_gpu(num_kv_blocks=1000), BLOCK, free, RESERVE)
    assert plan.num_kv_blocks == 1000
    assert plan.pool_bytes == int((free - RESERVE.total - 1000 * BLOCK) * 0.5)
    with pytest.raises(ValueError, match="do not fit"):
        plan_memory(_gpu(num_kv_blocks=10_000), BLOCK, free, RESERVE)


def test_a_reserve_beyond_the_free_memory_names_the_batch_limits() -> None:
    with pytest.raises(ValueError, match=r"steps of --max-num-seqs 256 and --max-num-batched-tokens 2048 need; lower them"):
        plan_memory(_gpu(max_num_seqs=256), BLOCK, 3 * GiB, RESERVE)


def test_unmeasured_reserve_keeps_a_tenth_and_at_least_a_gib() -> None:
    assert unmeasured_reserve(60 * GiB).total == 6 * GiB
    assert unmeasured_reserve(4 * GiB).total == GiB
