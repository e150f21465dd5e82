"""Every model family against transformers + PEFT, token for token: a tiny random model of each
(built locally with transformers, float32, with the family's quirks switched on: sliding windows
shorter than the prompts, soft-capping, q/k norms, tied embeddings, fused checkpoints, RoPE
scaling), four PEFT adapters on its linear projections (all-linear among them), and one engine
that mixes the adapters, the base model and prompts of different lengths in its batches, with
prompts chunked (a chunk smaller than every prompt) before they decode."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lora_helpers import check_exact_against_peft
from family_models import CASES, tiny_family_model


@pytest.mark.parametrize("case", list(CASES))
def test_family_token_exact_with_mixed_adapters(case: str, smollm2_tokenizer_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    folder = tiny_family_model(case, smollm2_tokenizer_dir, tmp_path / "model")
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    check_exact_against_peft(folder, hf_model, tmp_path, std=0.2, adapters=CASES[case][2], max_num_seqs=8,
                             max_num_batched_tokens=20)
