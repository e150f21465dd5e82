"""Random PEFT LoRA adapters for benchmarks, served from memory (no downloads, no disk).

``RandomAdapterSource`` serves one set of random PEFT files (rank r on all 7 projections of
the base model) under every adapter id: each id still gets its own copy in the GPU pool,
so the kernels read as many distinct adapters as the workload names.
"""

from __future__ import annotations

import json

import torch
from safetensors.torch import save

from loraplex.adapter_store.format.files import AdapterFiles, make_info
from loraplex.adapter_store.format.peft_format import parse_adapter_files
from loraplex.inference_server.model.config import ModelConfig

PROJ = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
        "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def peft_files(cfg: ModelConfig, rank: int, seed: int = 0) -> dict[str, bytes]:
    """adapter_config.json + adapter_model.safetensors (bf16, A and B ~ N(0, 0.01))."""
    gen = torch.Generator().manual_seed(seed)
    shapes = cfg.projection_shapes()
    tensors = {}
    for layer in range(cfg.num_layers):
        for proj, parent in PROJ.items():
            fan_in, fan_out = shapes[proj]
            stem = f"base_model.model.model.layers.{layer}.{parent}.{proj}"
            tensors[f"{stem}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=gen) * 0.01).bfloat16()
            tensors[f"{stem}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=gen) * 0.01).bfloat16()
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJ)}
    return {"adapter_config.json": json.dumps(config).encode(), "adapter_model.safetensors": save(tensors)}


class RandomAdapterSource:
    """AdapterSource over in-memory PEFT files: every id serves the same bytes."""

    def __init__(self, cfg: ModelConfig, rank: int, seed: int = 0) -> None:
        self.files = peft_files(cfg, rank, seed)
        self.spec = parse_adapter_files(self.files, cfg)

    def resolve(self, adapter_id: str) -> AdapterFiles:
        return AdapterFiles(make_info(adapter_id, self.files, self.spec, 0.0), self.spec, self.files)

    def get(self, adapter_id: str):
        return self.resolve(adapter_id).info
