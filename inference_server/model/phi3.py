"""The Phi-3 family (Phi-3 mini/small-context/medium, Phi-3.5 mini): the Llama module tree with
q/k/v and gate/up already fused in the checkpoint (``qkv_proj``, ``gate_up_proj``), which is also
what PEFT adapters target; a sliding window on every layer when the config sets one. Long-context
RoPE ("longrope") and partial rotary embeddings are refused by name (config.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from loraplex.adapter_store.format import architectures
from loraplex.inference_server.model.config import ModelConfig, common_fields, sliding_layers
from loraplex.inference_server.model.family import Family, WeightMap
from loraplex.inference_server.model.llama import LlamaForCausalLM, check_activation


def read_config(cfg: Mapping[str, Any], name: str) -> ModelConfig:
    """A Phi-3 config.json as a ModelConfig."""
    fields = common_fields(cfg, name)
    check_activation(cfg, "phi3")
    return ModelConfig(**fields, layer_windows=sliding_layers(cfg, cfg.get("sliding_window"), every_layer=True))


FAMILY = Family(
    architecture=architectures.for_model_type("phi3"),
    model_class=LlamaForCausalLM,
    read_config=read_config,
    weights=WeightMap(),  # the checkpoint's qkv_proj and gate_up_proj are ours as they are
)
