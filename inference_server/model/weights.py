"""Map Hugging Face checkpoint tensors onto our modules (fusing q/k/v and gate/up)."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from loraplex.inference_server.model.config import ModelConfig
from loraplex.inference_server.model.llama import MODEL_REGISTRY

_FUSED = {
    "q_proj": ("self_attn.qkv_proj", 0),
    "k_proj": ("self_attn.qkv_proj", 1),
    "v_proj": ("self_attn.qkv_proj", 2),
    "gate_proj": ("mlp.gate_up_proj", 0),
    "up_proj": ("mlp.gate_up_proj", 1),
}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.(weight|bias)$")
_NORM = re.compile(r"^model\.(layers\.\d+\.\w+_layernorm\.weight)$")
_PARTS = {"self_attn.qkv_proj": 3, "mlp.gate_up_proj": 2}


def build_model(
    config: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]], device: torch.device | str, dtype: torch.dtype
) -> nn.Module:
    """Build on the meta device, then load HF-named tensors with assign=True."""
    with torch.device("meta"):
        model = MODEL_REGISTRY[config.model_type](config)
    state = fuse_hf_tensors(tensors, device, dtype)
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing = sorted(set(model.state_dict()) - set(state))
    unexpected = sorted(set(state) - set(model.state_dict()))
    if missing or unexpected:
        raise ValueError(f"checkpoint does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.load_state_dict(state, assign=True, strict=True)
    model.init_rotary(device)
    return model.eval().requires_grad_(False)


def fuse_hf_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]], device: torch.device | str, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """HF names -> our state-dict names; q/k/v and gate/up concatenated along the output dim."""
    state: dict[str, torch.Tensor] = {}
    pending: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in tensors:
        tensor = tensor.to(device=device, dtype=dtype)
        key, part = _our_name(name)
        if part is None:
            state[key] = tensor
            continue
        parts = pending.setdefault(key, {})
        parts[part] = tensor
        if len(parts) == _PARTS[key.split(".", 2)[2].rsplit(".", 1)[0]]:
            state[key] = torch.cat([parts[i] for i in range(len(parts))], dim=0)
            del pending[key]
    if pending:
        raise ValueError(f"checkpoint is missing parts of fused weights: {sorted(pending)[:5]}")
    return state


def _our_name(name: str) -> tuple[str, int | None]:
    if name.startswith("model.") and not name.startswith("model.layers."):
        return name[len("model.") :], None  # embed_tokens, norm
    norm = _NORM.match(name)
    if norm is not None:
        return norm.group(1), None
    m = _LAYER.match(name)
    if m is None:
        return name, None  # lm_head.weight, or unexpected (reported by build_model)
    layer, parent, proj, kind = m.groups()
    if proj in _FUSED:
        fused, part = _FUSED[proj]
        return f"layers.{layer}.{fused}.{kind}", part
    return f"layers.{layer}.{parent}.{proj}.{kind}", None
