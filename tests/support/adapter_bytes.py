"""Test helpers: PEFT adapter files written byte by byte (any ranks, patterns, layers, dtypes,
tensor order), the reference CPU packing, and the adapter cases the packing tests share."""

from __future__ import annotations

import json
import random
import struct

import torch

from loraplex.adapter_store.format.architectures import ALL_TARGETS
from loraplex.adapter_store.format.peft_format import parse_adapter_files
from loraplex.inference_server.lora.pool.packing import pack_adapter
from loraplex.inference_server.lora.pool.tensor_views import tensor_views
from loraplex.inference_server.model.config import ModelConfig

CFG = ModelConfig(model_type="llama", vocab_size=64, hidden_size=32, intermediate_size=48, num_layers=3,
                  num_heads=4, num_kv_heads=2, head_dim=8)
PARENT = ALL_TARGETS  # module -> its parent, as PEFT names them
_ST_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def safetensors_bytes(tensors: list[tuple[str, torch.Tensor]]) -> bytes:
    """A safetensors file with the tensors back to back in the given order (safetensors'
    own writer sorts them; other writers need not)."""
    header, pos, blobs = {}, 0, []
    for name, t in tensors:
        raw = t.contiguous().view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [pos, pos + len(raw)]}
        pos += len(raw)
        blobs.append(raw)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head + b"".join(blobs)


def adapter_files(cfg: ModelConfig, config: dict, dtype: torch.dtype, seed: int, shuffle: bool) -> dict[str, bytes]:
    """PEFT files for ``config`` (r, targets, rank/alpha patterns, layers) with random weights."""
    gen = torch.Generator().manual_seed(seed)
    shapes = cfg.projection_shapes()
    layers = config.get("layers_to_transform") or range(cfg.num_layers)
    tensors = []
    for layer in layers:
        for proj in config["target_modules"]:
            key = f"model.layers.{layer}.{PARENT[proj]}.{proj}"
            rank = next((v for k, v in config.get("rank_pattern", {}).items() if key.endswith(k)), config["r"])
            fan_in, fan_out = shapes[proj]
            stem = f"base_model.model.{key}"
            tensors.append((f"{stem}.lora_A.weight", torch.randn(rank, fan_in, generator=gen).to(dtype)))
            tensors.append((f"{stem}.lora_B.weight", torch.randn(fan_out, rank, generator=gen).to(dtype)))
    if shuffle:
        random.Random(seed).shuffle(tensors)
    return {"adapter_config.json": json.dumps({"peft_type": "LORA", **config}).encode(),
            "adapter_model.safetensors": safetensors_bytes(tensors)}


def reference(files: dict[str, bytes], cfg: ModelConfig, dtype: torch.dtype) -> torch.Tensor:
    spec = parse_adapter_files(files, cfg)
    return pack_adapter(spec, tensor_views(files["adapter_model.safetensors"]), cfg, dtype)[0]


ALL = list(CFG.projection_shapes())
CASES = {
    **{f"r{r}": dict(r=r, lora_alpha=2 * r, target_modules=ALL) for r in (4, 8, 16, 32, 64)},
    "r5-odd": dict(r=5, lora_alpha=3, target_modules=ALL),
    "rslora-subset": dict(r=8, lora_alpha=4, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"]),
    "mixed-ranks": dict(r=8, lora_alpha=16, target_modules=ALL,
                        rank_pattern={"model.layers.1.self_attn.q_proj": 16, "down_proj": 4, "layers.2.mlp.up_proj": 2}),
    "alpha-pattern": dict(r=8, lora_alpha=16, target_modules=["q_proj", "o_proj", "gate_proj"],
                          alpha_pattern={"model.layers.0.self_attn.o_proj": 3, "gate_proj": 5}),
    "layers-subset": dict(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj", "down_proj"], layers_to_transform=[0, 2],
                          rank_pattern={"down_proj": 2}, alpha_pattern={"o_proj": 2}),
    "one-layer-one-module": dict(r=16, lora_alpha=16, target_modules=["k_proj"], layers_to_transform=[1]),
    "zero-alpha-first-layer": dict(r=4, lora_alpha=8, target_modules=["v_proj"],
                                   alpha_pattern={"model.layers.0.self_attn.v_proj": 0}),
}
