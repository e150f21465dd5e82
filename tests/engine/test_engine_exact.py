"""Token-exact against transformers + PEFT: base model and four adapters, mixed in batches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lora_helpers import check_exact_against_peft


def test_tiny_llama_token_exact_with_mixed_adapters(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    check_exact_against_peft(tiny_llama_dir, hf_model, tmp_path, std=0.1, max_num_seqs=32,
                             max_num_batched_tokens=512)


def test_tiny_qwen2_token_exact_with_mixed_adapters(tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32).eval()
    check_exact_against_peft(tiny_qwen2_dir, hf_model, tmp_path, std=0.1, max_num_seqs=8,
                             max_num_batched_tokens=128)


@pytest.mark.slow
def test_smollm2_token_exact_with_mixed_adapters(smollm2_gguf: str, tmp_path: Path) -> None:
    """The real model (GGUF, dequantized) with four PEFT adapters, 6 chat prompts x 5, one engine."""
    import os

    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(smollm2_gguf), gguf_file=os.path.basename(smollm2_gguf), dtype=torch.float32
    ).eval()
    check_exact_against_peft(Path(smollm2_gguf), hf_model, tmp_path, std=0.02, max_num_seqs=32,
                             max_num_batched_tokens=1024)
