"""The base-model families loraplex serves, as an adapter sees them: their Hugging Face names,
the linear projections PEFT may target (names, shapes as functions of the config, which fused
LoRA call each feeds) and PEFT's default targets.

This is the one table of targets and shapes: the store checks uploads against it without torch,
the inference server's pool and LoRA tables are laid out from it, and each model family
(inference_server/model/<family>.py) builds its modules against its entry here. A family's
modules, checkpoint mapping and quirks live in its own file; what an adapter must fit lives here.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class Slot(enum.Enum):
    """Where a decoder layer's LoRA deltas land: each slot is one fused kernel call over the
    slices of the targets that feed it (q/k/v into the attention's input projection, gate/up into
    the MLP's, o and down alone)."""

    QKV = "qkv"
    O = "o"
    GATE_UP = "gate_up"
    DOWN = "down"


# How each slot splits under tensor parallelism: column-parallel slots split B by output rows,
# row-parallel slots split A by input columns (inference_server/parallel/lora.py).
COLUMN_PARALLEL = frozenset({Slot.QKV, Slot.GATE_UP})


@dataclass(frozen=True, slots=True)
class Dims:
    """A base model's sizes, as its LoRA targets need them."""

    num_layers: int
    hidden: int
    intermediate: int
    q: int  # query heads x head_dim
    kv: int  # key/value heads x head_dim

    def __post_init__(self) -> None:
        for name in ("num_layers", "hidden", "intermediate", "q", "kv"):
            if getattr(self, name) <= 0:
                raise ValueError(f"model config: {name} must be > 0, got {getattr(self, name)}")

    def size(self, name: str) -> int:
        """One of hidden, intermediate, q, kv by name."""
        return getattr(self, name)

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any]) -> Dims:
        """The sizes a Hugging Face config.json gives (head_dim explicit or hidden / heads)."""
        try:
            heads = cfg["num_attention_heads"]
            kv_heads = cfg.get("num_key_value_heads") or heads
            head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
            if heads <= 0 or kv_heads <= 0 or heads % kv_heads:
                raise ValueError(f"model config: num_attention_heads ({heads}) must be a positive multiple of "
                                 f"num_key_value_heads ({kv_heads})")
            return cls(num_layers=cfg["num_hidden_layers"], hidden=cfg["hidden_size"],
                       intermediate=cfg["intermediate_size"], q=heads * head_dim, kv=kv_heads * head_dim)
        except KeyError as exc:
            raise ValueError(f"model config: missing required field {exc.args[0]!r}") from None


@dataclass(frozen=True, slots=True)
class LoraTarget:
    """A linear projection of every decoder layer that a PEFT LoRA may adapt.

    ``module`` and ``parent`` are the names PEFT writes (``model.layers.N.<parent>.<module>``);
    ``fan_in`` and ``parts`` name Dims sizes: the output is the parts side by side (one part, or
    q/kv/kv for a checkpoint that fuses q, k and v into one linear)."""

    module: str
    parent: str
    slot: Slot
    fan_in: str
    parts: tuple[str, ...]

    def shape(self, dims: Dims) -> tuple[int, int]:
        """(in_features, out_features) for these sizes."""
        return dims.size(self.fan_in), sum(dims.size(p) for p in self.parts)


def _attn(module: str, slot: Slot, fan_in: str, *parts: str) -> LoraTarget:
    return LoraTarget(module, "self_attn", slot, fan_in, parts)


def _mlp(module: str, slot: Slot, fan_in: str, *parts: str) -> LoraTarget:
    return LoraTarget(module, "mlp", slot, fan_in, parts)


# q, k, v, o, gate, up, down as separate linears (Llama, Mistral, Qwen, Gemma checkpoints).
SEPARATE_TARGETS = (
    _attn("q_proj", Slot.QKV, "hidden", "q"),
    _attn("k_proj", Slot.QKV, "hidden", "kv"),
    _attn("v_proj", Slot.QKV, "hidden", "kv"),
    _attn("o_proj", Slot.O, "q", "hidden"),
    _mlp("gate_proj", Slot.GATE_UP, "hidden", "intermediate"),
    _mlp("up_proj", Slot.GATE_UP, "hidden", "intermediate"),
    _mlp("down_proj", Slot.DOWN, "intermediate", "hidden"),
)
# q/k/v and gate/up fused in the checkpoint itself (Phi-3): PEFT targets the fused linears.
FUSED_TARGETS = (
    _attn("qkv_proj", Slot.QKV, "hidden", "q", "kv", "kv"),
    _attn("o_proj", Slot.O, "q", "hidden"),
    _mlp("gate_up_proj", Slot.GATE_UP, "hidden", "intermediate", "intermediate"),
    _mlp("down_proj", Slot.DOWN, "intermediate", "hidden"),
)


@dataclass(frozen=True, slots=True)
class Architecture:
    """A family of base models as adapters see it. ``targets`` are in slot order (the row order
    of the LoRA tables); ``peft_defaults`` is what PEFT adapts when target_modules is left out
    (None: PEFT has no default for the family and refuses such a config)."""

    family: str
    model_types: tuple[str, ...]
    hf_classes: tuple[str, ...]
    targets: tuple[LoraTarget, ...]
    peft_defaults: tuple[str, ...] | None

    def __post_init__(self) -> None:
        slots = [t.slot for t in self.targets]
        if slots != sorted(slots, key=list(Slot).index) or set(slots) != set(Slot):
            raise ValueError(f"{self.family}: targets must feed every slot, in slot order")

    def target(self, module: str) -> LoraTarget:
        for t in self.targets:
            if t.module == module:
                return t
        raise KeyError(module)

    @property
    def target_modules(self) -> tuple[str, ...]:
        return tuple(t.module for t in self.targets)

    def shapes(self, dims: Dims) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of every target, by PEFT module name, in table order."""
        return {t.module: t.shape(dims) for t in self.targets}

    def slot_rows(self) -> dict[Slot, tuple[int, int]]:
        """Each slot's (first row, number of slices) in the LoRA tables."""
        rows: dict[Slot, tuple[int, int]] = {}
        for row, t in enumerate(self.targets):
            first, count = rows.get(t.slot, (row, 0))
            rows[t.slot] = (first, count + 1)
        return rows

    def slot_widths(self, dims: Dims) -> dict[Slot, tuple[int, ...]]:
        """The output widths of each slot's slices (the widths of y's column slices)."""
        out: dict[Slot, tuple[int, ...]] = {}
        for t in self.targets:
            out[t.slot] = (*out.get(t.slot, ()), t.shape(dims)[1])
        return out


_DEFAULTS = ("q_proj", "v_proj")  # PEFT's TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

ARCHITECTURES = (
    Architecture("llama", ("llama", "mistral", "qwen2"),
                 ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"), SEPARATE_TARGETS, _DEFAULTS),
    Architecture("qwen3", ("qwen3",), ("Qwen3ForCausalLM",), SEPARATE_TARGETS, _DEFAULTS),
    Architecture("gemma", ("gemma2", "gemma3_text"), ("Gemma2ForCausalLM", "Gemma3ForCausalLM"), SEPARATE_TARGETS,
                 _DEFAULTS),
    Architecture("phi3", ("phi3",), ("Phi3ForCausalLM",), FUSED_TARGETS, None),
)
MODEL_TYPES = tuple(m for a in ARCHITECTURES for m in a.model_types)
_BY_MODEL_TYPE = {m: a for a in ARCHITECTURES for m in a.model_types}
_BY_CLASS = {c: m for a in ARCHITECTURES for c, m in zip(a.hf_classes, a.model_types)}
# Every module name some family lets PEFT target, and its parent (an adapter checked without a base).
ALL_TARGETS = {t.module: t.parent for a in ARCHITECTURES for t in a.targets}


def for_model_type(model_type: str) -> Architecture:
    """The family serving ``model_type``; ValueError listing the supported ones."""
    if model_type not in _BY_MODEL_TYPE:
        raise ValueError(f"unsupported model type {model_type!r}; supported: {list(MODEL_TYPES)}")
    return _BY_MODEL_TYPE[model_type]


def model_type_of(cfg: Mapping[str, Any]) -> str:
    """The model type a Hugging Face config.json names (its ``architectures`` first, then
    ``model_type``); ValueError naming the field and listing what is supported."""
    classes = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    for name in classes:
        if name in _BY_CLASS:
            if model_type in _BY_MODEL_TYPE and model_type != _BY_CLASS[name]:
                raise ValueError(f"config.json architectures {classes} ({_BY_CLASS[name]}) and model_type "
                                 f"{model_type!r} disagree (transformers builds the model_type's model); "
                                 "make them name one family")
            return _BY_CLASS[name]
    if model_type in _BY_MODEL_TYPE:
        return model_type
    if model_type == "gemma3" or "Gemma3ForConditionalGeneration" in classes:
        raise ValueError("model_type 'gemma3' (Gemma3ForConditionalGeneration) is Gemma 3's multimodal checkpoint; "
                         "loraplex serves its text model: a checkpoint with model_type 'gemma3_text' "
                         "(Gemma3ForCausalLM, e.g. gemma-3-270m, gemma-3-1b)")
    raise ValueError(f"unsupported architecture (config.json architectures {classes}, model_type {model_type!r}); "
                     f"supported architectures: {list(_BY_CLASS)}, model types: {list(MODEL_TYPES)}")
