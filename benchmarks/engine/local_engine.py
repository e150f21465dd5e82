"""An engine over a model file and a folder of PEFT adapters made by the peft library, as
bench_cpu_vs_transformers runs it (tests/support/lora_helpers.py makes its adapters with
``make_peft_adapter`` too: tests reach benchmarks by their public names, never the reverse)."""

from __future__ import annotations

import asyncio
import copy
from pathlib import Path

import torch

from loraplex.inference_server.build import build_engine
from loraplex.inference_server.engine.async_engine import AsyncEngine
from loraplex.inference_server.engine.config import EngineConfig
from loraplex.inference_server.engine.request import GenerationRequest, SamplingParams, StoppingCriteria, TokenEvent
from loraplex.inference_server.model.checkpoint import ModelSource


def make_peft_adapter(hf_model, out: Path, lora_kwargs: dict, seed: int, std: float) -> Path:  # noqa: ANN001
    """Save a PEFT LoRA adapter with random non-zero A and B (std ``std``) for ``hf_model``."""
    from peft import LoraConfig, get_peft_model

    peft_model = get_peft_model(copy.deepcopy(hf_model), LoraConfig(**lora_kwargs))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * std)
    peft_model.save_pretrained(out, safe_serialization=True)
    return out


def load_engine(model_path: str | Path, adapter_dir: Path, **config) -> AsyncEngine:  # noqa: ANN003
    """An AsyncEngine (not started) over a model folder/file and a local adapter directory, built
    as the server builds it."""
    cfg = EngineConfig(**{"num_kv_blocks": 256, "block_size": 16, **config})
    return build_engine(AsyncEngine, cfg, ModelSource(path=str(model_path)), adapter_dir, progress=False)


def greedy_request(rid: str, prompt: list[int], adapter: str | None, n: int) -> GenerationRequest:
    """Greedy, exactly ``n`` new tokens (EOS ignored)."""
    return GenerationRequest(rid, tuple(prompt), adapter, SamplingParams(),
                             StoppingCriteria(max_new_tokens=n, ignore_eos=True))


def run_all(engine: AsyncEngine, requests: list[GenerationRequest]) -> dict[str, list[TokenEvent]]:
    """Start the engine, run all requests concurrently, stop it; events by request id."""

    async def collect(request: GenerationRequest) -> list[TokenEvent]:
        return [event async for event in engine.generate(request)]

    async def main() -> dict[str, list[TokenEvent]]:
        await engine.start()
        try:
            results = await asyncio.gather(*(collect(r) for r in requests))
        finally:
            await engine.shutdown()
        return {r.request_id: events for r, events in zip(requests, results)}

    return asyncio.run(main())
