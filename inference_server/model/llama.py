"""The Llama family: Llama 2/3/3.1/3.2, Mistral, Qwen2/2.5 (and SmolLM, which is Llama).

A pre-norm decoder: RMSNorm, GQA attention with RoPE (rope scaling "linear" or "llama3"), RMSNorm,
SiLU-gated MLP; optional tied embeddings; q/k/v biases (Qwen2, or Llama's attention_bias, which
also biases o_proj); a sliding window on every layer (Mistral) or on the layers Qwen2's
use_sliding_window picks. Qwen3 and Phi-3 build this module tree too (qwen3.py, phi3.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from loraplex.adapter_store.format import architectures
from loraplex.inference_server.model.config import ModelConfig, common_fields, sliding_layers
from loraplex.inference_server.model.family import FUSED_QKV_GATE_UP, Family, GgufMap, WeightMap
from loraplex.inference_server.model.layers import Attention, DecoderLM, ForwardBatch, GatedMLP, RMSNorm
from loraplex.inference_server.model.rope import RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg)

    def forward(
        self, x: torch.Tensor, delta: torch.Tensor | None, rotary: RotaryEmbedding, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual stream x plus the previous block's output delta -> (stream, this layer's MLP output)."""
        h, x = self.input_layernorm(x, delta)
        h, x = self.post_attention_layernorm(x, self.self_attn(h, rotary, batch))
        return x, self.mlp(h)


class LlamaForCausalLM(DecoderLM):
    """Token ids [T] (rows of many sequences, flattened) -> hidden [T, H]; logits for chosen rows."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, [DecoderLayer(cfg, i) for i in range(cfg.num_layers)])


def refuse_fields(cfg: Mapping[str, Any], family: str, **unsupported: object) -> None:
    """Refuse a config field set to anything but its harmless value (``field=harmless``), by name."""
    for name, harmless in unsupported.items():
        value = cfg.get(name, harmless)
        if value not in (harmless, None):
            raise ValueError(f"{name}: {value!r} is not supported for {family} models (only {harmless!r})")


def check_activation(cfg: Mapping[str, Any], family: str) -> None:
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act: {act!r} is not supported for {family} models (only 'silu')")


def qwen_windows(cfg: Mapping[str, Any]) -> tuple[int | None, ...]:
    """Qwen2/Qwen3's windows: none unless use_sliding_window, then the layers layer_types names
    (or, in older configs, the layers from max_window_layers on)."""
    if not cfg.get("use_sliding_window", False) or cfg.get("sliding_window") is None:
        return ()
    if cfg.get("layer_types") is not None:
        return sliding_layers(cfg, cfg["sliding_window"], every_layer=False)
    first = cfg.get("max_window_layers", 28)
    return tuple(cfg["sliding_window"] if i >= first else None for i in range(cfg["num_hidden_layers"]))


def read_config(cfg: Mapping[str, Any], name: str) -> ModelConfig:
    """A Llama, Mistral or Qwen2 config.json as a ModelConfig."""
    fields = common_fields(cfg, name)
    model_type = fields["model_type"]
    check_activation(cfg, model_type)
    refuse_fields(cfg, model_type, mlp_bias=False)
    if model_type == "llama":
        bias = bool(cfg.get("attention_bias", False))
        return ModelConfig(**fields, attention_bias=bias, o_proj_bias=bias)
    if model_type == "mistral":  # MistralConfig's default window, as transformers reads a config without one
        window = cfg.get("sliding_window", 4096)
        return ModelConfig(**fields, layer_windows=sliding_layers(cfg, window, every_layer=True))
    # Qwen2's q/k/v always have biases: transformers' Qwen2 ignores attention_bias
    return ModelConfig(**fields, attention_bias=True, layer_windows=qwen_windows(cfg))


FAMILY = Family(
    architecture=architectures.for_model_type("llama"),
    model_class=LlamaForCausalLM,
    read_config=read_config,
    weights=WeightMap(fused=FUSED_QKV_GATE_UP),
    # llama.cpp converts Mistral as "llama" too; its Qwen2 converter does not permute q/k
    gguf=GgufMap(architectures={"llama": "llama", "qwen2": "qwen2"}, permute_qk=("llama",)),
)
