"""Random PEFT LoRA adapters on every projection of a dummy model, written as folders a server reads.

Thousands of 7B-shaped adapters (80 MB each at rank 16 in bf16) would take minutes and hundreds
of GB to write one by one, so ``distinct_files`` = K writes K weight files per rank and every
adapter folder hard-links (os.link) one of them: the server still fetches, validates, stages and
places each id on its own (its pool and host tier are keyed by id), only the values repeat, and
values do not change speed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def adapter_names(count: int, prefix: str = "bench") -> list[str]:
    """The ids of ``count`` benchmark adapters: bench-0, bench-1, ..."""
    return [f"{prefix}-{i}" for i in range(count)]


def weight_tensors(model_config, rank: int, generator, dtype) -> dict:  # noqa: ANN001  (torch types)
    """PEFT tensor names -> random lora_A (rank x in) and lora_B (out x rank), std 0.01."""
    import torch

    tensors = {}
    for layer in range(model_config.num_layers):
        for module, (fan_in, fan_out) in model_config.projection_shapes().items():
            parent = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            tensors[f"{key}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=generator) * 0.01).to(dtype)
            tensors[f"{key}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=generator) * 0.01).to(dtype)
    return tensors


def config_json(rank: int) -> str:
    return json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(TARGETS)})


def write_adapters(model: str, adapter_dir: Path, names: list[str], ranks: list[int], dtype: str = "float32",
                   distinct_files: int | None = None, seed: int = 0) -> dict[str, int]:
    """Adapter folders ``adapter_dir/<name>`` for the dummy preset ``model``; adapter i has rank
    ``ranks[i % len(ranks)]``. With ``distinct_files`` = K, K weight files per rank are written
    in the sibling folder ``<adapter_dir>-weights`` and adapter i hard-links file
    (i // len(ranks)) % K of its rank. Returns {name: rank}."""
    import torch
    from safetensors.torch import save_file

    from loraplex.inference_server.model.dummy import preset_config

    cfg = preset_config(model)
    torch_dtype = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(seed)
    adapter_dir.mkdir(parents=True, exist_ok=True)
    weights_dir = adapter_dir.with_name(adapter_dir.name + "-weights")
    shared: dict[tuple[int, int], Path] = {}
    out = {}
    for i, name in enumerate(names):
        rank = ranks[i % len(ranks)]
        folder = adapter_dir / name
        folder.mkdir()
        (folder / "adapter_config.json").write_text(config_json(rank))
        target = folder / "adapter_model.safetensors"
        if distinct_files is None:
            save_file(weight_tensors(cfg, rank, gen, torch_dtype), str(target))
        else:
            key = (rank, (i // len(ranks)) % distinct_files)
            if key not in shared:
                shared[key] = weights_dir / f"rank{rank}-{key[1]}.safetensors"
                shared[key].parent.mkdir(exist_ok=True)
                save_file(weight_tensors(cfg, rank, gen, torch_dtype), str(shared[key]))
            os.link(shared[key], target)
        out[name] = rank
    return out


def link_subset(adapter_dir: Path, names: list[str], dest: Path) -> Path:
    """A folder ``dest`` holding only ``names`` (symlinks to ``adapter_dir/<name>``): a server
    given it stores exactly those adapters."""
    dest.mkdir(parents=True)
    for name in names:
        (dest / name).symlink_to(adapter_dir / name, target_is_directory=True)
    return dest
