"""The base model's architecture, as one typed, validated config.

The fields every decoder has come first; then each family's quirks, with Llama's values as the
defaults (a Llama config sets none of them). Each family's file reads its config.json into this
(``read_config`` in inference_server/model/<family>.py, chosen by registry.py), refusing by name
any field that would change results and is not implemented.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from loraplex.adapter_store.format.architectures import Architecture, Dims, LoraTarget, for_model_type, model_type_of

ACTIVATIONS = ("silu", "gelu_tanh")  # the gated MLP's: SiLU (Llama), GELU's tanh form (Gemma)
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v biases (Qwen2)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = "model"
    # -- family quirks (Llama's values by default) --
    o_proj_bias: bool = False  # a bias on the attention's output projection (Llama/Qwen3 attention_bias)
    hidden_act: str = "silu"  # one of ACTIVATIONS
    qk_norm: bool = False  # an RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3)
    embed_scale: float | None = None  # embeddings times this (Gemma: sqrt(hidden_size))
    attn_scale: float | None = None  # the query scale (None: head_dim ** -0.5; Gemma: query_pre_attn_scalar ** -0.5)
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap) before the softmax (Gemma 2)
    final_softcap: float | None = None  # the same on the logits (Gemma 2)
    layer_windows: tuple[int | None, ...] = ()  # per layer: the sliding window (keys seen), None: all; ()
    local_rope_theta: float | None = None  # the RoPE base of the windowed layers (Gemma 3), unscaled
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for_model_type(self.model_type)  # ValueError listing the supported model types
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config: {name} must be > 0, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"model config: num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"model config: hidden_act {self.hidden_act!r} is not supported; supported: {ACTIVATIONS}")
        check_rope_scaling(self.rope_scaling)
        if self.layer_windows and len(self.layer_windows) != self.num_layers:
            raise ValueError(f"model config: {len(self.layer_windows)} layer windows for {self.num_layers} layers")
        if any(w is not None and w <= 0 for w in self.layer_windows):
            raise ValueError(f"model config: sliding windows must be > 0, got {self.layer_windows}")
        for name in ("attn_softcap", "final_softcap", "attn_scale", "embed_scale", "local_rope_theta"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"model config: {name} must be > 0, got {value}")

    @property
    def architecture(self) -> Architecture:
        """The family's entry in the table of LoRA targets and shapes (adapter_store/format)."""
        return for_model_type(self.model_type)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def dims(self) -> Dims:
        return Dims(num_layers=self.num_layers, hidden=self.hidden_size, intermediate=self.intermediate_size,
                    q=self.q_size, kv=self.kv_size)

    @property
    def lora_targets(self) -> tuple[LoraTarget, ...]:
        """The projections an adapter may adapt, in the LoRA tables' row order."""
        return self.architecture.targets

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of the LoRA-targetable projections, by PEFT name, in table order."""
        return self.architecture.shapes(self.dims)

    def window(self, layer: int) -> int | None:
        """Layer ``layer``'s sliding window (the keys a query sees, itself included), or None."""
        return self.layer_windows[layer] if self.layer_windows else None

    def to_hf(self) -> dict[str, Any]:
        """The config.json dict transformers would read for this model (Llama-family models only:
        tests and dummies build transformers peers from it)."""
        if self.architecture.family != "llama":
            raise ValueError(f"to_hf covers the llama family, not {self.model_type}")
        arch = {m: c for m, c in zip(self.architecture.model_types, self.architecture.hf_classes)}[self.model_type]
        out = {
            "architectures": [arch],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        }
        if self.model_type == "llama":
            out["attention_bias"] = self.attention_bias
        return out


def rope_type(scaling: Mapping[str, Any] | None) -> str:
    """The rope_scaling dict's type ("default" when there is none)."""
    return (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))


# the fields each rope type computes with: transformers refuses a config without them, so filling
# any with a default would run a model the reference does not
_ROPE_FIELDS = {"linear": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}


def check_rope_scaling(scaling: Mapping[str, Any] | None) -> None:
    """A supported rope type with every field it computes with, each a positive number (llama3's
    low_freq_factor below its high_freq_factor); anything else is refused by name."""
    kind = rope_type(scaling)
    if kind not in ROPE_TYPES:
        raise ValueError(f"rope_scaling: type {kind!r} is not supported; supported: {list(ROPE_TYPES)}")
    for name in _ROPE_FIELDS.get(kind, ()):
        value = (scaling or {}).get(name)
        if value is None:
            raise ValueError(f"rope_scaling: {kind} needs {name} (transformers refuses it too); "
                             f"the config gives {sorted(scaling or {})}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"rope_scaling: {name} must be a number > 0, got {value!r}")
    if kind == "llama3" and not scaling["low_freq_factor"] < scaling["high_freq_factor"]:
        raise ValueError(f"rope_scaling: low_freq_factor ({scaling['low_freq_factor']}) must be below "
                         f"high_freq_factor ({scaling['high_freq_factor']})")


# transformers' default rms_norm_eps where a config.json leaves it out: 1e-6 but for these
_RMS_NORM_EPS = {"phi3": 1e-5}
# config.json fields read as integers (where present) and as numbers: a wrong type is refused by name
_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window")
_NUMBER_FIELDS = ("rms_norm_eps", "rope_theta")


_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def _check_types(cfg: Mapping[str, Any]) -> None:
    """ValueError naming the first required field left out (or null) or field of the wrong type."""
    for key in _REQUIRED:
        if cfg.get(key) is None:
            raise ValueError(f"missing required field {key!r}")
    for key in _INT_FIELDS:
        value = cfg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ValueError(f"{key}: must be an integer, got {value!r}")
    for key in _NUMBER_FIELDS:
        value = cfg.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ValueError(f"{key}: must be a number, got {value!r}")


def common_fields(cfg: Mapping[str, Any], name: str) -> dict[str, Any]:
    """The ModelConfig fields every family reads the same way from a config.json, model_type
    included (its architectures first). Raises ValueError naming a missing required field or an
    unimplemented feature every family refuses (a quantized checkpoint, partial rotary embeddings)."""
    if cfg.get("quantization_config") is not None:
        method = (cfg["quantization_config"] or {}).get("quant_method", "?")
        raise ValueError(f"quantization_config: quantized checkpoints ({method}) are not supported; "
                         "serve the unquantized (float16/bfloat16/float32) weights")
    _check_types(cfg)
    try:
        heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        params = rope_parameters(cfg)
        model_type = model_type_of(cfg)
        fields = dict(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", _RMS_NORM_EPS.get(model_type, 1e-6)),
            rope_theta=float(params.get("rope_theta", cfg.get("rope_theta", 10000.0))),
            rope_scaling=_scaling(params),
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ()),
            name=name,
        )
    except KeyError as exc:
        raise ValueError(f"missing required field {exc.args[0]!r}") from exc
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor {partial}: RoPE over part of each head is not supported (only 1.0)")
    return fields  # the rest (RoPE type, sizes) ModelConfig checks as it is built


def rope_parameters(cfg: Mapping[str, Any], layer_type: str = "full_attention") -> dict[str, Any]:
    """The RoPE settings of ``layer_type`` layers: transformers >= 5 writes theta and scaling as one
    ``rope_parameters`` dict (per layer type where layers differ, as Gemma 3's), older configs
    ``rope_theta`` and ``rope_scaling``."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    if isinstance(params, dict) and not any(isinstance(v, dict) for v in params.values()):
        return dict(params)
    out = dict(cfg.get("rope_scaling") or {})
    if "rope_theta" in cfg:
        out["rope_theta"] = cfg["rope_theta"]
    return out


def _scaling(params: Mapping[str, Any]) -> dict[str, Any] | None:
    if rope_type(params) == "default":
        return None
    return {k: v for k, v in params.items() if k not in ("rope_theta", "partial_rotary_factor")}


def sliding_layers(cfg: Mapping[str, Any], window: int | None, every_layer: bool) -> tuple[int | None, ...]:
    """Per-layer windows from ``layer_types`` ("sliding_attention" / "full_attention"), or every
    layer windowed (``every_layer``: Mistral, Phi-3), or none. A layer type the engine does not
    implement is refused by name."""
    if window is None:
        return ()
    layers = cfg["num_hidden_layers"]
    types = cfg.get("layer_types")
    if types is None:
        return (window,) * layers if every_layer else ()
    unknown = sorted(set(types) - {"sliding_attention", "full_attention"})
    if unknown or len(types) != layers:
        raise ValueError(f"layer_types: {unknown or types} not supported (one of sliding_attention, full_attention "
                         f"per layer, {layers} layers)")
    return tuple(window if t == "sliding_attention" else None for t in types)
