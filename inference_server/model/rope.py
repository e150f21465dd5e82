"""Rotary position embeddings (the Hugging Face Llama layout: rotate halves)."""

from __future__ import annotations

import math
from typing import Any

import torch



def inv_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] (float32) and the attention scaling factor.

    Supports no scaling, "linear", and "llama3"; any other rope type is a clear error.
    """
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float) / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv, 1.0
    if kind == "linear":
        return inv / float(scaling["factor"]), 1.0
    if kind == "llama3":
        return _llama3(inv, scaling), 1.0
    raise ValueError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3")


def _llama3(inv: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    # every field is there: ModelConfig refuses a llama3 scaling without one (check_rope_scaling)
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(torch.nn.Module):
    """cos/sin tables for every position up to max_positions, computed once in float32
    (applied with the KV-cache write by ``loraplex.kernels.fused_ops.rope_and_cache``)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        inv, attn_scale = inv_frequencies(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * attn_scale, persistent=False)
        self.register_buffer("sin", emb.sin() * attn_scale, persistent=False)
