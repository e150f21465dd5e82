"""Token-exact against transformers + PEFT: base model and four adapters, mixed in batches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lora_helpers import ADAPTER_CONFIGS, greedy_request, hf_greedy, load_engine, make_peft_adapter, run_all, tokens_of

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity to a child.",
    "List three prime numbers.",
    "How do I boil an egg?",
    "Translate 'good morning' into Spanish.",
]
NEW_TOKENS = 32


def _reference(hf_model, adapter_dir: Path, prompts: list[list[int]]) -> dict[tuple[int, str | None], list[int]]:
    """transformers + PEFT greedy tokens for every (prompt, adapter) pair."""
    from peft import PeftModel

    expected = {(i, None): hf_greedy(hf_model, p, NEW_TOKENS) for i, p in enumerate(prompts)}
    names = list(ADAPTER_CONFIGS)
    peft_model = PeftModel.from_pretrained(hf_model, adapter_dir / names[0], adapter_name=names[0])
    for name in names[1:]:
        peft_model.load_adapter(adapter_dir / name, adapter_name=name)
    for name in names:
        peft_model.set_adapter(name)
        for i, p in enumerate(prompts):
            expected[(i, name)] = hf_greedy(peft_model, p, NEW_TOKENS)
    return expected


def _check_exact(model_dir: Path, hf_model, tmp_path: Path, std: float, **engine_config) -> None:
    adapter_dir = tmp_path / "adapters"
    for seed, (name, kwargs) in enumerate(ADAPTER_CONFIGS.items()):
        make_peft_adapter(hf_model, adapter_dir / name, kwargs, seed=seed, std=std)
    engine = load_engine(model_dir, adapter_dir, **engine_config)
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    expected = _reference(hf_model, adapter_dir, prompts)
    requests = [
        greedy_request(f"{i}-{name}", prompts[i], name, NEW_TOKENS) for (i, name) in expected
    ]
    got = run_all(engine, requests)
    mismatches = [r.request_id for r, key in zip(requests, expected) if tokens_of(got[r.request_id]) != expected[key]]
    assert not mismatches, f"tokens differ from transformers + PEFT for {mismatches}"
    # the adapters must matter: each changes the output of at least one prompt
    for name in ADAPTER_CONFIGS:
        assert any(expected[(i, name)] != expected[(i, None)] for i in range(len(prompts))), name


def test_tiny_llama_token_exact_with_mixed_adapters(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    _check_exact(tiny_llama_dir, hf_model, tmp_path, std=0.1, max_num_seqs=32, max_num_batched_tokens=512)


def test_tiny_qwen2_token_exact_with_mixed_adapters(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32).eval()
    _check_exact(tiny_qwen2_dir, hf_model, tmp_path, std=0.1, max_num_seqs=8, max_num_batched_tokens=128)


@pytest.mark.slow
def test_smollm2_token_exact_with_mixed_adapters(smollm2_gguf: str, tmp_path: Path) -> None:
    """The real model (GGUF, dequantized) with four PEFT adapters, 6 chat prompts x 5, one engine."""
    import os

    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_gguf), gguf_file=os.path.basename(smollm2_gguf), dtype=torch.float32
    ).eval()
    _check_exact(Path(smollm2_gguf), hf_model, tmp_path, std=0.02, max_num_seqs=32, max_num_batched_tokens=1024)
