"""Test helpers: PEFT adapters made with the peft library, the transformers greedy
reference, and an in-process engine built around a loaded model."""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path

import torch

from benchmarks.engine.local_engine import make_peft_adapter
from loraplex.inference_server.engine.async_engine import AsyncEngine
from loraplex.inference_server.engine.config import EngineConfig
from loraplex.inference_server.engine.factory import assemble
from loraplex.inference_server.engine.request import GenerationRequest, SamplingParams, StoppingCriteria, TokenEvent
from loraplex.inference_server.lora.local_directory import LocalAdapterDirectory
from loraplex.inference_server.model.checkpoint import ModelSource
from loraplex.inference_server.model.loading import load_checkpoint
from loraplex.inference_server.model.weights import build_model

# Four adapters that exercise the PEFT features the engine must honour.
ADAPTER_CONFIGS = {
    "attn-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "all-r16-rslora": dict(
        r=16, lora_alpha=8, use_rslora=True,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
    "mlp-r64": dict(r=64, lora_alpha=32, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "layers-r4": dict(
        r=4, lora_alpha=8, target_modules=["q_proj", "o_proj", "down_proj"], layers_to_transform=[0, 2],
        rank_pattern={"down_proj": 2}, alpha_pattern={"o_proj": 2},
    ),
}


def make_test_adapters(model_dir: Path, root: Path, std: float = 0.1) -> Path:
    """The four ADAPTER_CONFIGS adapters for the HF model in ``model_dir``, under ``root``."""
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    for seed, (name, kwargs) in enumerate(ADAPTER_CONFIGS.items()):
        make_peft_adapter(hf_model, root / name, kwargs, seed=seed, std=std)
    return root


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy tokens, one at a time with its KV cache; EOS neither stops nor is
    masked (the engine's ``ignore_eos``). Works across the transformers 4/5 cache renames."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"
    tokens: list[int] = []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            tokens.append(int(out.logits[0, -1].argmax()))
            cache = getattr(out, name)
            out = model(input_ids=torch.tensor([[tokens[-1]]]), use_cache=True, **{name: cache})
    return tokens


def load_engine(model_path: str | Path, adapter_dir: Path, runner_factory=None, **config) -> AsyncEngine:
    """An AsyncEngine (not started) over a model folder/file and a local adapter directory
    (runner_factory: as ``assemble``'s)."""
    cfg = EngineConfig(**{"num_kv_blocks": 256, "block_size": 16, **config})
    ckpt = load_checkpoint(ModelSource(path=str(model_path)), cfg.torch_dtype)
    model = build_model(ckpt.config, ckpt.iter_tensors(), cfg.device, cfg.torch_dtype)
    return assemble(AsyncEngine, cfg, model, ckpt.config, ckpt.tokenizer, LocalAdapterDirectory(adapter_dir, ckpt.config),
                    runner_factory=runner_factory)


def greedy_request(rid: str, prompt: list[int], adapter: str | None, n: int, **stop) -> GenerationRequest:
    return GenerationRequest(
        rid, tuple(prompt), adapter, SamplingParams(), StoppingCriteria(max_new_tokens=n, ignore_eos=True, **stop)
    )


async def collect(engine: AsyncEngine, request: GenerationRequest) -> list[TokenEvent]:
    return [event async for event in engine.generate(request)]


def run_all(engine: AsyncEngine, requests: list[GenerationRequest]) -> dict[str, list[TokenEvent]]:
    """Start the engine, run all requests concurrently, stop it; events by request id."""

    async def main() -> dict[str, list[TokenEvent]]:
        await engine.start()
        try:
            results = await asyncio.gather(*(collect(engine, r) for r in requests))
        finally:
            await engine.shutdown()
        return {r.request_id: events for r, events in zip(requests, results)}

    return asyncio.run(main())


def tokens_of(events: list[TokenEvent]) -> list[int]:
    return [t for e in events for t in e.token_ids]


def text_of(events: list[TokenEvent]) -> str:
    return "".join(e.text for e in events)


PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity to a child.",
    "List three prime numbers.",
    "How do I boil an egg?",
    "Translate 'good morning' into Spanish.",
]
NEW_TOKENS = 32


def _peft_reference(hf_model, adapter_dir: Path, prompts: list[list[int]],
                    names: list[str]) -> dict[tuple[int, str | None], list[int]]:
    """transformers + PEFT greedy tokens for every (prompt, adapter) pair."""
    from peft import PeftModel

    expected = {(i, None): hf_greedy(hf_model, p, NEW_TOKENS) for i, p in enumerate(prompts)}
    peft_model = PeftModel.from_pretrained(hf_model, adapter_dir / names[0], adapter_name=names[0])
    for name in names[1:]:
        peft_model.load_adapter(adapter_dir / name, adapter_name=name)
    for name in names:
        peft_model.set_adapter(name)
        for i, p in enumerate(prompts):
            expected[(i, name)] = hf_greedy(peft_model, p, NEW_TOKENS)
    return expected


def check_exact_against_peft(model_dir: Path, hf_model, tmp_path: Path, std: float,
                             adapters: dict[str, dict] = ADAPTER_CONFIGS, **engine_config) -> None:
    """loraplex's greedy tokens (engine built with ``engine_config``) equal transformers + PEFT's
    for PROMPTS x (base + the ``adapters``: name -> LoraConfig kwargs), all in one engine, mixed
    in batches."""
    adapter_dir = tmp_path / "adapters"
    for seed, (name, kwargs) in enumerate(adapters.items()):
        make_peft_adapter(hf_model, adapter_dir / name, kwargs, seed=seed, std=std)
    engine = load_engine(model_dir, adapter_dir, **engine_config)
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    expected = _peft_reference(hf_model, adapter_dir, prompts, list(adapters))
    requests = [
        greedy_request(f"{i}-{name}", prompts[i], name, NEW_TOKENS) for (i, name) in expected
    ]
    got = run_all(engine, requests)
    mismatches = [r.request_id for r, key in zip(requests, expected) if tokens_of(got[r.request_id]) != expected[key]]
    assert not mismatches, f"tokens differ from transformers + PEFT for {mismatches}"
    # the adapters must matter: each changes the output of at least one prompt
    for name in adapters:
        assert any(expected[(i, name)] != expected[(i, None)] for i in range(len(prompts))), name
