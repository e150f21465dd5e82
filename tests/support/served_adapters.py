"""The four test adapters (and an extra one) as PEFT folders for the tiny Llama, the prompts the edge tests send, and waiting for an engine to go idle."""

from __future__ import annotations

import time
from pathlib import Path
import pytest
import torch
from lora_helpers import ADAPTER_CONFIGS, make_peft_adapter
from loraplex.inference_server.engine.async_engine import AsyncEngine


ADAPTERS = list(ADAPTER_CONFIGS)  # four PEFT adapters exercising rank, rsLoRA, layer and pattern options


PROMPTS = ["What is the capital of France?", "Write a haiku about the sea.", "Explain gravity to a child.",
           "List three prime numbers.", "How do I boil an egg?", "Say hello in Spanish."]


@pytest.fixture(scope="module")
def peft_sources(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The four test adapters plus an extra one (for the upload test), as PEFT folders."""
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    root = tmp_path_factory.mktemp("peft")
    specs = {**ADAPTER_CONFIGS, "extra": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "down_proj"])}
    return {name: make_peft_adapter(hf_model, root / name, kwargs, seed=i, std=0.1)
            for i, (name, kwargs) in enumerate(specs.items())}


def _wait_idle(engine: AsyncEngine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        stats = engine.stats()
        if stats.num_running == 0 and stats.num_waiting == 0 and stats.free_kv_blocks == stats.total_kv_blocks:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"engine not idle: {stats}")
        time.sleep(0.02)
