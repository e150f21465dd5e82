"""benchmarks/engine/bench_pool.py's decode rows run end to end on the CPU (a tiny model), so the
device time spent on them is not lost to a broken script: every loading phase runs between
idle windows, loads what it says, and reports its rise against its own neighbours."""

from __future__ import annotations

import re

import pytest

from benchmarks.common.random_adapters import RandomAdapterSource
from benchmarks.engine import bench_pool, pool_ttft
from loraplex.inference_server.engine.async_engine import AsyncEngine
from loraplex.inference_server.engine.config import EngineConfig
from loraplex.inference_server.engine.factory import assemble
from loraplex.inference_server.model.config import ModelConfig
from loraplex.inference_server.model.dummy import byte_level_tokenizer
from loraplex.inference_server.model.llama import LlamaForCausalLM


@pytest.fixture
def tiny_engine():
    cfg = ModelConfig(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=4096, name="tiny")
    model = LlamaForCausalLM(cfg)
    model.init_rotary("cpu")
    model.eval().requires_grad_(False)
    source = RandomAdapterSource(cfg, 4)
    size = 2 * sum(a + b for a, b in cfg.projection_shapes().values()) * 4 * cfg.num_layers * 4  # float32, rank 4
    config = EngineConfig(device="cpu", dtype="float32", max_num_seqs=32, max_num_batched_tokens=4096,
                          adapter_pool_bytes=24 * size, adapter_host_cache_bytes=90 * size, num_kv_blocks=4096,
                          max_lora_rank=4)
    return assemble(AsyncEngine, config, model, cfg, byte_level_tokenizer(cfg.vocab_size), source)


ROW = re.compile(r"\((\d+) steps\) \| ([\d.]+) ms \(idle around it ([\d.]+) ms\) \| ([+-][\d.]+)%")


def test_decode_rows_bracket_every_loading_phase(tiny_engine, monkeypatch) -> None:
    monkeypatch.setattr(bench_pool, "IDLE_STEPS", 5)
    mgr = tiny_engine._manager
    rows = bench_pool.decode_rows(tiny_engine, mgr, split=True)
    assert rows[0].startswith("| decode step, batch 32, no loads")
    phases = [name for name, _, _ in bench_pool.load_phases(mgr, True)]
    assert len(rows) == 1 + len(phases)
    for row, name in zip(rows[1:], phases):
        assert name in row
        steps, busy, base, rise = re.search(ROW, row).groups()
        assert int(steps) >= 1 and float(base) > 0
        expected = (float(busy) / float(base) - 1) * 100
        assert float(rise) == pytest.approx(expected, rel=0.01, abs=0.5)  # from the printed, rounded figures
    assert "(target <= +5%)" in rows[1]
    held = set(mgr.host.versions()) | set(mgr.resident_ids())
    assert {f"load-{i}" for i in range(20)} <= held  # the full loads really loaded
    assert {f"h-{i}" for i in range(40, 60)} <= set(mgr.host.versions())  # host-only loads reached the host tier


TTFT = re.compile(r"\| TTFT, ([^|]+) \| ([\d.]+) ms \|")


def test_ttft_rows_time_every_tier_including_a_real_redis(tiny_engine, redis_url) -> None:
    """The TTFT rows run end to end: each tier's requests really hit that tier (pool_ttft
    checks the pool's counters), and the Redis-only adapters come from a real redis-server
    through the store with their blob files gone."""
    mgr = tiny_engine._manager
    cfg, memory = mgr.config, mgr.source
    mgr.source = pool_ttft.RoutedSource(memory, pool_ttft.redis_source(redis_url, cfg, memory.files, 3))
    rows = pool_ttft.ttft_rows(tiny_engine, mgr, redis_count=3)
    found = dict(TTFT.search(r).groups() for r in rows)
    assert len(found) == 4 and all(float(v) > 0 for v in found.values())
    assert any("only in Redis" in k for k in found)
    assert {f"{pool_ttft.REDIS_PREFIX}{i}" for i in range(3)} <= set(mgr.host.versions())
