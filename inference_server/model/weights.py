"""Map Hugging Face checkpoint tensors onto a family's modules (its WeightMap: fusing q/k/v and
gate/up where the checkpoint keeps them apart, folding a norm offset into norm weights)."""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from loraplex.inference_server.model.config import ModelConfig
from loraplex.inference_server.model.family import WeightMap
from loraplex.inference_server.model.registry import family_of

_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def build_model(
    config: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]], device: torch.device | str, dtype: torch.dtype
) -> nn.Module:
    """Build on the meta device, then load HF-named tensors with assign=True."""
    model = new_model(config)
    state = fuse_hf_tensors(tensors, device, dtype, config)
    load_state(model, state, config)
    model.init_rotary(device)
    return model.eval().requires_grad_(False)


def new_model(config: ModelConfig) -> nn.Module:
    """The family's model for ``config``, on the meta device (no memory for weights)."""
    with torch.device("meta"):
        return family_of(config.model_type).model_class(config)


def load_state(model: nn.Module, state: dict[str, torch.Tensor], config: ModelConfig) -> None:
    """Load a full state dict with assign=True; ValueError naming what is missing or unexpected."""
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    want = model.state_dict()
    missing, unexpected = sorted(set(want) - set(state)), sorted(set(state) - set(want))
    if missing or unexpected:
        raise ValueError(f"checkpoint does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.load_state_dict(state, assign=True, strict=True)


def fuse_hf_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]], device: torch.device | str, dtype: torch.dtype, config: ModelConfig
) -> dict[str, torch.Tensor]:
    """HF names -> our state-dict names, by the family's weight map: parts of a fused linear
    concatenated along the output dim, the norm offset added to norm weights (in float32)."""
    weights = family_of(config.model_type).weights
    norms = _norm_names(weights, config)
    state: dict[str, torch.Tensor] = {}
    pending: dict[str, dict[int, torch.Tensor]] = {}
    for name, tensor in tensors:
        if weights.norm_offset and name in norms:
            tensor = tensor.to(torch.float32) + weights.norm_offset
        tensor = tensor.to(device=device, dtype=dtype)
        key, part, parts = our_name(name, weights)
        if part is None:
            state[key] = tensor
            continue
        pieces = pending.setdefault(key, {})
        pieces[part] = tensor
        if len(pieces) == parts:
            state[key] = torch.cat([pieces[i] for i in range(parts)], dim=0)
            del pending[key]
    if pending:
        raise ValueError(f"checkpoint is missing parts of fused weights: {sorted(pending)[:5]}")
    return state


def our_name(name: str, weights: WeightMap) -> tuple[str, int | None, int]:
    """(our state-dict name, part index or None, number of parts) of an HF tensor name."""
    if name.startswith("model.") and not name.startswith("model.layers."):
        return name[len("model.") :], None, 1  # embed_tokens, norm
    m = _LAYER.match(name)
    if m is None:
        return name, None, 1  # lm_head.weight, or unexpected (reported by load_state)
    layer, path, kind = m.groups()
    parent, _, proj = path.rpartition(".")
    if proj in weights.fused:
        fused, part, parts = weights.fused[proj]
        return f"layers.{layer}.{parent}.{fused}.{kind}", part, parts
    return f"layers.{layer}.{path}.{kind}", None, 1


def _norm_names(weights: WeightMap, config: ModelConfig) -> frozenset[str]:
    """The HF names of every norm weight of ``config``'s checkpoint."""
    per_layer = [f"model.layers.{i}.{n}.weight" for i in range(config.num_layers) for n in weights.norms(config)]
    return frozenset(["model.norm.weight", *per_layer])
