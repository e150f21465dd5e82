"""50 adapters through a pool that holds 6: Zipf traffic gives exactly the tokens of an engine
whose pool holds them all."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from inference_server.lora.packing import plan_layout
from lora_helpers import greedy_request, load_engine, make_peft_adapter, run_all, tokens_of

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
