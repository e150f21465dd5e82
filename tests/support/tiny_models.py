"""Tiny random Hugging Face models saved as model folders (the fixtures and the family tests
build their models with it; a helper module, since tests/gpu has a conftest of its own)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch


def save_tiny_model(model_cls: type, config: object, tokenizer_dir: Path, out: Path, seed: int) -> Path:
    """Random float32 model (seeded, global RNG untouched) + tokenizer files -> a HF folder."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = model_cls(config).to(torch.float32).eval()
        with torch.no_grad():  # transformers zero-inits biases; make bias loading observable
            for name, param in model.named_parameters():
                if name.endswith(".bias"):
                    param.normal_(0.0, 0.02)
    model.save_pretrained(out, safe_serialization=True)
    for f in os.listdir(tokenizer_dir):
        shutil.copy(tokenizer_dir / f, out / f)
    return out
