"""50 adapters through a pool that holds 6: Zipf traffic gives exactly the tokens of an engine
whose pool holds them all."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from lora_helpers import greedy_request, load_engine, make_peft_adapter, run_all, tokens_of

from loraplex.inference_server.lora.pool.packing import plan_layout

NUM_ADAPTERS = 50
TARGETS = [["q_proj", "v_proj"], ["o_proj", "down_proj"], ["gate_proj", "up_proj"], ["q_proj", "k_proj", "v_proj"]]


@pytest.fixture(scope="module")
def many_adapters(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("many")
    for i in range(NUM_ADAPTERS):
        kwargs = dict(r=(4, 8, 16)[i % 3], lora_alpha=16, target_modules=TARGETS[i % len(TARGETS)])
        make_peft_adapter(hf_model, root / f"tenant{i % 5}" / f"a{i}", kwargs, seed=i, std=0.1)
    return root


def _zipf_requests(engine, n: int, seed: int) -> list:
    rng = random.Random(seed)
    names = [f"tenant{i % 5}/a{i}" for i in range(NUM_ADAPTERS)]
    weights = [1 / (k + 1) ** 1.5 for k in range(NUM_ADAPTERS)]
    prompts = [engine.tokenizer.encode(t) for t in ("Hi!", "Tell me more", "Numbers: 1 2 3", "Why?")]
    return [
        greedy_request(f"q{i}", prompts[i % len(prompts)], rng.choices(names, weights)[0], 12) for i in range(n)
    ]


def test_small_pool_matches_a_pool_holding_everything(tiny_llama_dir: Path, many_adapters: Path) -> None:
    probe = load_engine(tiny_llama_dir, many_adapters)
    largest = max(
        plan_layout(probe.adapters.resolve(info.adapter_id).spec, probe._core.runner.config).num_elements
        for info in probe.adapters.list()
    )
    assert len(probe.adapters.list()) == NUM_ADAPTERS
    six = 6 * (largest + 64) * 4  # bytes of float32
    small = load_engine(tiny_llama_dir, many_adapters, adapter_pool_bytes=six, adapter_host_cache_bytes=six,
                        max_num_seqs=16, max_num_batched_tokens=256)
    big = load_engine(tiny_llama_dir, many_adapters, adapter_pool_bytes=64 * six, max_num_seqs=16,
                      max_num_batched_tokens=256)
    requests = _zipf_requests(small, 200, seed=3)
    got = run_all(small, requests)
    expected = run_all(big, requests)
    assert {k: tokens_of(v) for k, v in got.items()} == {k: tokens_of(v) for k, v in expected.items()}
    stats = small._manager.stats()
    assert stats.used_bytes <= stats.capacity_bytes == six and stats.resident < NUM_ADAPTERS
    assert stats.counters["gpu_evictions"] > 0 and stats.in_use == 0
    assert big._manager.stats().counters["gpu_evictions"] == 0


@pytest.mark.slow
def test_small_pool_over_grpc_matches_an_all_resident_server(tiny_llama_dir: Path, many_adapters: Path) -> None:
    """200 Zipf requests over gRPC against a server whose pool holds six of the 50 adapters:
    every stream equals the stream of a server whose pool holds them all."""
    import asyncio

    from loraplex.clients import AsyncLoraplexClient, LoraplexClient
    from loraplex.inference_server.build import build_engine
    from loraplex.inference_server.engine.async_engine import AsyncEngine
    from loraplex.inference_server.engine.config import EngineConfig
    from loraplex.inference_server.model.checkpoint import ModelSource
    from loraplex.inference_server.server.app import ServerOptions
    import re
    import urllib.request

    from server_helpers import ServerThread, free_port

    probe = load_engine(tiny_llama_dir, many_adapters)
    largest = max(
        plan_layout(probe.adapters.resolve(info.adapter_id).spec, probe._core.runner.config).num_elements
        for info in probe.adapters.list()
    )
    six = 6 * (largest + 64) * 4
    jobs = [(r.prompt_token_ids, r.adapter_id) for r in _zipf_requests(probe, 200, seed=11)]

    def serve(pool_bytes: int) -> list[list[int]]:
        srv = ServerThread(ServerOptions(port=0, metrics_port=free_port(), default_max_new_tokens=12))
        config = EngineConfig(num_kv_blocks=256, max_num_seqs=16, max_num_batched_tokens=256,
                              adapter_pool_bytes=pool_bytes, adapter_host_cache_bytes=pool_bytes)
        engine = build_engine(AsyncEngine, config, ModelSource(path=str(tiny_llama_dir)), many_adapters,
                              progress=False)
        srv.attach(engine)
        try:
            async def run() -> list:
                async with AsyncLoraplexClient(srv.address) as client:
                    return await asyncio.gather(*(
                        client.generate_text(token_ids=list(p), adapter=a, ignore_eos=True, max_new_tokens=12)
                        for p, a in jobs))
            results = asyncio.run(run())
            url = f"http://127.0.0.1:{srv.server.metrics_port}/metrics"
            text = urllib.request.urlopen(url, timeout=10).read().decode()

            def metric(pattern: str) -> float:
                return float(re.search(pattern + r" ([0-9.e+]+)", text).group(1))

            evictions = metric(r'loraplex_adapter_pool_evictions_total\{tier="device"\}')
            assert metric("loraplex_adapter_load_seconds_count") > 0
            hits = metric(r'loraplex_adapter_pool_hits_total\{tier="device"\}')
            assert hits > 0
            # every acquisition is a device hit, a join of a load under way, or a load of its own
            acquisitions = sum(a is not None for _, a in jobs)
            joins, loads = metric("loraplex_adapter_pool_joins_total"), metric(
                r'loraplex_adapter_pool_misses_total\{tier="device"\}')
            assert hits + joins + loads == acquisitions, (hits, joins, loads, acquisitions)
            assert (evictions > 0) == (pool_bytes == six)
            with LoraplexClient(srv.address) as client:
                listed = {a.adapter_id: a for a in client.list_adapters()}
                info = client.server_info()
                assert len(listed) == NUM_ADAPTERS
                resident = {i for i, a in listed.items() if a.resident}
                assert resident == set(engine.adapters.resident_ids()) and resident
                assert info.resident_adapters == len(resident)
                assert 0 < info.adapter_pool_used_bytes <= info.adapter_pool_bytes == pool_bytes
                some = next(iter(resident))
                assert client.get_adapter(some).resident
            return [list(r.token_ids) for r in results]
        finally:
            srv.close()

    assert serve(six) == serve(64 * six)
