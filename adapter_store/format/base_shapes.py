"""What an adapter must fit: the base model's layer count and the shapes of the projections
PEFT adapters target. The inference server's ModelConfig provides them; the store sidecar,
which has no model, reads them from the base model's Hugging Face config.json."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

# Architectures whose decoder is the Llama block (RMSNorm, GQA attention with RoPE, SiLU
# gated MLP). Qwen2 adds a bias to q/k/v; the rest is the same module tree.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
MODEL_TYPES = frozenset(SUPPORTED_ARCHITECTURES.values())


class BaseShapes(Protocol):
    """The base model as adapter validation sees it."""

    @property
    def num_layers(self) -> int: ...

    def projection_shapes(self) -> dict[str, tuple[int, int]]: ...


def llama_projection_shapes(hidden: int, intermediate: int, q_size: int, kv_size: int) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of the 7 LoRA-targetable projections, by PEFT name."""
    h, i = hidden, intermediate
    return {
        "q_proj": (h, q_size),
        "k_proj": (h, kv_size),
        "v_proj": (h, kv_size),
        "o_proj": (q_size, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


def model_type_of(cfg: dict[str, Any]) -> str:
    """The Llama-family model type a Hugging Face config.json names; ValueError if unsupported."""
    archs = cfg.get("architectures") or []
    model_type = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if model_type is None:
        model_type = cfg.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(
            f"unsupported architecture {archs or cfg.get('model_type')!r}; supported: "
            f"{sorted(SUPPORTED_ARCHITECTURES)}"
        )
    return model_type


@dataclass(frozen=True, slots=True)
class HFBaseShapes:
    """BaseShapes read from a config.json (the sidecar's ``--base-config``)."""

    num_layers: int
    hidden_size: int
    intermediate_size: int
    q_size: int
    kv_size: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden_size", "intermediate_size", "q_size", "kv_size"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config: {name} must be > 0, got {getattr(self, name)}")

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        return llama_projection_shapes(self.hidden_size, self.intermediate_size, self.q_size, self.kv_size)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> HFBaseShapes:
        model_type_of(cfg)
        heads = cfg["num_attention_heads"]
        kv_heads = cfg.get("num_key_value_heads") or heads
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
            raise ValueError(f"model config: num_attention_heads ({heads}) must be a positive multiple of "
                             f"num_key_value_heads ({kv_heads})")
        return cls(num_layers=cfg["num_hidden_layers"], hidden_size=cfg["hidden_size"],
                   intermediate_size=cfg["intermediate_size"], q_size=heads * head_dim, kv_size=kv_heads * head_dim)
