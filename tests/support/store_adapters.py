"""Real PEFT adapters (made with peft on a tiny random Llama) and broken variants of them."""

from __future__ import annotations

import copy
import json
import struct
from pathlib import Path

from loraplex.inference_server.model.config import ModelConfig
from loraplex.inference_server.model.registry import config_from_hf

TINY_LLAMA = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=128, max_position_embeddings=64,
)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, dtype, target modules)
ADAPTERS = {
    "r4-fp32": (4, "float32", ["q_proj", "v_proj"]),
    "r16-bf16": (16, "bfloat16", ALL),
    "r32-bf16": (32, "bfloat16", ["gate_proj", "up_proj", "down_proj"]),
    "r64-fp32": (64, "float32", ["q_proj", "k_proj", "v_proj", "o_proj"]),
}
CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


def tiny_base() -> ModelConfig:
    from transformers import LlamaConfig  # noqa: PLC0415

    return config_from_hf(LlamaConfig(**TINY_LLAMA).to_dict(), name="tiny-llama")


def make_adapters(out: Path, hidden_size: int = 64) -> dict[str, dict[str, bytes]]:
    """{name: {file name: bytes}} for every entry of ADAPTERS, as peft saves them (README.md too)."""
    import torch  # noqa: PLC0415
    from peft import LoraConfig, get_peft_model  # noqa: PLC0415
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415

    with torch.random.fork_rng():
        torch.manual_seed(7)
        model = LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, "hidden_size": hidden_size}))
        result = {}
        for name, (rank, dtype, targets) in ADAPTERS.items():
            lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False)
            peft_model = get_peft_model(copy.deepcopy(model), lora).to(getattr(torch, dtype))
            folder = out / name
            peft_model.save_pretrained(folder, safe_serialization=True)
            result[name] = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
    return result


def peft_files(files: dict[str, bytes]) -> dict[str, bytes]:
    """The two files the store keeps."""
    return {CONFIG: files[CONFIG], WEIGHTS: files[WEIGHTS]}


def with_config(files: dict[str, bytes], **changes: object) -> dict[str, bytes]:
    config = json.loads(files[CONFIG])
    config.update(changes)
    return {**peft_files(files), CONFIG: json.dumps(config).encode()}


def rewrite_tensors(files: dict[str, bytes], edit) -> dict[str, bytes]:  # noqa: ANN001
    """Apply ``edit(tensors: dict[name, np.ndarray]) -> dict`` to the safetensors file (kept as float32)."""
    import numpy as np  # noqa: PLC0415
    from safetensors.numpy import save  # noqa: PLC0415

    header_len = struct.unpack("<Q", files[WEIGHTS][:8])[0]
    header = json.loads(files[WEIGHTS][8 : 8 + header_len])
    header.pop("__metadata__", None)
    data = files[WEIGHTS][8 + header_len :]
    tensors = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        raw = np.frombuffer(data[begin:end], dtype=np.uint16 if entry["dtype"] == "BF16" else np.float32)
        if entry["dtype"] == "BF16":
            raw = (raw.astype(np.uint32) << 16).view(np.float32)
        tensors[name] = raw.reshape(entry["shape"]).copy()
    return {**peft_files(files), WEIGHTS: save(edit(tensors))}
