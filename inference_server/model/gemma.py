"""The Gemma family: Gemma 2 and Gemma 3 (text: Gemma3ForCausalLM, model_type gemma3_text).

What sets it apart from Llama: RMSNorm of the (1 + w) form (folded into the weights as they load),
embeddings scaled by sqrt(hidden_size), a GELU (tanh form) gated MLP, a norm after the attention
and around the MLP (pre/post-feedforward norms), the query scaled by query_pre_attn_scalar ** -0.5,
tied embeddings by default, and sliding-window layers beside global ones. Gemma 2: attention and
final-logit soft-capping, every other layer windowed. Gemma 3: q/k norms, five windowed layers to
one global, the windowed layers with their own RoPE base (rope_local_base_freq).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from loraplex.adapter_store.format import architectures
from loraplex.inference_server.model.config import (ModelConfig, common_fields, rope_parameters, rope_type,
                                                    sliding_layers)
from loraplex.inference_server.model.family import FUSED_QKV_GATE_UP, Family, GgufMap, WeightMap
from loraplex.inference_server.model.layers import Attention, DecoderLM, ForwardBatch, GatedMLP, RMSNorm
from loraplex.inference_server.model.llama import refuse_fields
from loraplex.inference_server.model.rope import RotaryEmbedding

GEMMA_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
               "post_feedforward_layernorm")


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        local = cfg.local_rope_theta is not None and cfg.window(layer) is not None
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer, rotary_kind="local" if local else "global")
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self, x: torch.Tensor, delta: torch.Tensor | None, rotary: RotaryEmbedding, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual stream x plus the previous block's output delta -> (stream, this layer's output):
        x += norm(attention(norm(x))), then the output is norm(mlp(norm(x)))."""
        h, x = self.input_layernorm(x, delta)
        attn = self.post_attention_layernorm(self.self_attn(h, rotary, batch))[0]
        h, x = self.pre_feedforward_layernorm(x, attn)
        return x, self.post_feedforward_layernorm(self.mlp(h))[0]


class GemmaForCausalLM(DecoderLM):
    """Token ids [T] (rows of many sequences, flattened) -> hidden [T, H]; logits for chosen rows."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__(cfg, [GemmaDecoderLayer(cfg, i) for i in range(cfg.num_layers)])


def _activation(cfg: Mapping[str, Any]) -> str:
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"hidden_activation: {act!r} is not supported for Gemma models (only 'gelu_pytorch_tanh')")
    return "gelu_tanh"


def _gemma_fields(cfg: Mapping[str, Any], name: str) -> dict[str, Any]:
    """What Gemma 2 and 3 read alike (with Gemma's defaults where a field is left out)."""
    fields = common_fields(cfg, name)
    fields.update(rms_norm_eps=cfg.get("rms_norm_eps", 1e-6), tie_word_embeddings=cfg.get("tie_word_embeddings", True),
                  hidden_act=_activation(cfg), embed_scale=math.sqrt(fields["hidden_size"]),
                  attn_scale=float(cfg.get("query_pre_attn_scalar", 256)) ** -0.5,
                  attn_softcap=cfg.get("attn_logit_softcapping"), final_softcap=cfg.get("final_logit_softcapping"))
    bias = bool(cfg.get("attention_bias", False))
    fields.update(attention_bias=bias, o_proj_bias=bias)
    return fields


def _gemma2(cfg: Mapping[str, Any], name: str) -> ModelConfig:
    fields = _gemma_fields(cfg, name)
    fields.update(attn_softcap=cfg.get("attn_logit_softcapping", 50.0),
                  final_softcap=cfg.get("final_logit_softcapping", 30.0))
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                                       for i in range(cfg["num_hidden_layers"])]
    windows = sliding_layers({**cfg, "layer_types": types}, cfg.get("sliding_window", 4096), every_layer=False)
    return ModelConfig(**fields, layer_windows=windows)


def _gemma3(cfg: Mapping[str, Any], name: str) -> ModelConfig:
    refuse_fields(cfg, "gemma3_text", use_bidirectional_attention=False)
    fields = _gemma_fields(cfg, name)
    pattern = cfg.get("sliding_window_pattern", cfg.get("_sliding_window_pattern", 6))
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                                       for i in range(cfg["num_hidden_layers"])]
    windows = sliding_layers({**cfg, "layer_types": types}, cfg.get("sliding_window", 4096), every_layer=False)
    local = rope_parameters(cfg, "sliding_attention")
    if isinstance((cfg.get("rope_parameters") or {}).get("sliding_attention"), dict):
        if rope_type(local) != "default":
            raise ValueError(f"rope_parameters.sliding_attention: rope type {rope_type(local)!r} is not supported "
                             "for the windowed layers (only 'default')")
        local_theta = float(local.get("rope_theta", 10000.0))
    else:  # before transformers 5: rope_local_base_freq, and rope_scaling for the global layers only
        local_theta = float(cfg.get("rope_local_base_freq", 10000.0))
    if "rope_theta" not in rope_parameters(cfg):
        fields["rope_theta"] = 1_000_000.0  # Gemma3TextConfig's default global base
    return ModelConfig(**fields, qk_norm=True, layer_windows=windows, local_rope_theta=local_theta)


def read_config(cfg: Mapping[str, Any], name: str) -> ModelConfig:
    """A Gemma 2 or Gemma 3 (text) config.json as a ModelConfig."""
    reader = _gemma2 if (cfg.get("model_type") == "gemma2" or "Gemma2ForCausalLM" in (cfg.get("architectures") or [])) \
        else _gemma3
    return reader(cfg, name)


FAMILY = Family(
    architecture=architectures.for_model_type("gemma3_text"),
    model_class=GemmaForCausalLM,
    read_config=read_config,
    weights=WeightMap(fused=FUSED_QKV_GATE_UP, layer_norms=GEMMA_NORMS, norm_offset=1.0),
    gguf=GgufMap(
        architectures={"gemma2": "gemma2", "gemma3": "gemma3_text"},
        metadata={"attention.sliding_window": "sliding_window",
                  "attn_logit_softcapping": "attn_logit_softcapping",
                  "final_logit_softcapping": "final_logit_softcapping"},
        blocks={"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm", "attn_q_norm": "self_attn.q_norm",
                "attn_k_norm": "self_attn.k_norm"},
        norm_offset=1.0,
    ),
)
