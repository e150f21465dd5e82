"""The Qwen3 family (dense): the Llama module tree with an RMSNorm over each head of q and k
before RoPE, no q/k/v biases unless attention_bias (which also biases o_proj), and the sliding
window Qwen's use_sliding_window picks."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from loraplex.adapter_store.format import architectures
from loraplex.inference_server.model.config import ModelConfig, common_fields
from loraplex.inference_server.model.family import FUSED_QKV_GATE_UP, Family, GgufMap, WeightMap
from loraplex.inference_server.model.llama import LlamaForCausalLM, check_activation, qwen_windows


def read_config(cfg: Mapping[str, Any], name: str) -> ModelConfig:
    """A Qwen3 config.json as a ModelConfig."""
    fields = common_fields(cfg, name)
    check_activation(cfg, "qwen3")
    bias = bool(cfg.get("attention_bias", False))
    return ModelConfig(**fields, attention_bias=bias, o_proj_bias=bias, qk_norm=True, layer_windows=qwen_windows(cfg))


FAMILY = Family(
    architecture=architectures.for_model_type("qwen3"),
    model_class=LlamaForCausalLM,
    read_config=read_config,
    weights=WeightMap(fused=FUSED_QKV_GATE_UP),
    gguf=GgufMap(architectures={"qwen3": "qwen3"}, blocks={"attn_q_norm": "self_attn.q_norm",
                                                           "attn_k_norm": "self_attn.k_norm"}),
)
