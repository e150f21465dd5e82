"""What a model family declares, as data, for the rest of the system: the entry of its LoRA
targets and shapes (adapter_store/format/architectures.py), its model class, how its config.json
becomes a ModelConfig, how its checkpoint's tensor names map onto its modules, and how its GGUF
files name theirs. Each family's file (llama.py, qwen3.py, gemma.py, phi3.py) ends with one
``Family``; registry.py maps model types to them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from loraplex.adapter_store.format.architectures import Architecture
from loraplex.inference_server.model.config import ModelConfig

# q/k/v and gate/up as separate linears in the checkpoint, fused in the model:
# HF projection -> (our fused linear, part, parts)
FUSED_QKV_GATE_UP = {
    "q_proj": ("qkv_proj", 0, 3),
    "k_proj": ("qkv_proj", 1, 3),
    "v_proj": ("qkv_proj", 2, 3),
    "gate_proj": ("gate_up_proj", 0, 2),
    "up_proj": ("gate_up_proj", 1, 2),
}
LLAMA_NORMS = ("input_layernorm", "post_attention_layernorm")
QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")


@dataclass(frozen=True, slots=True)
class WeightMap:
    """A family's checkpoint as it maps onto its modules (HF names and layouts in, ours out).

    fused: HF projection name -> (our fused linear, part index, number of parts), concatenated
    along the output dim. layer_norms: the per-layer norms, as HF names them under
    ``model.layers.N.`` (q/k norms are added when the config has them). norm_offset: added to
    every norm weight as it loads (Gemma's checkpoints hold w for a (1 + w) norm)."""

    fused: Mapping[str, tuple[str, int, int]] = field(default_factory=dict)
    layer_norms: tuple[str, ...] = LLAMA_NORMS
    norm_offset: float = 0.0

    def norms(self, cfg: ModelConfig) -> tuple[str, ...]:
        return self.layer_norms + (QK_NORMS if cfg.qk_norm else ())


@dataclass(frozen=True, slots=True)
class GgufMap:
    """How llama.cpp's GGUF files of the family name things.

    architectures: GGUF ``general.architecture`` -> model_type. metadata: ``{arch}.<key>`` -> the
    config.json field it gives, beyond the keys every family shares (gguf_file.py). blocks: GGUF
    block tensor name -> HF name under ``model.layers.N.``, beyond the shared ones. permute_qk:
    the GGUF architectures whose q/k rows llama.cpp permuted (its Llama converter). norm_offset:
    what llama.cpp added to norm weights (Gemma: 1), taken off again so the stream is in HF's
    convention."""

    architectures: Mapping[str, str]
    metadata: Mapping[str, str] = field(default_factory=dict)
    blocks: Mapping[str, str] = field(default_factory=dict)
    permute_qk: tuple[str, ...] = ()
    norm_offset: float = 0.0


@dataclass(frozen=True, slots=True)
class Family:
    """One model family: its table entry, modules, config reader, checkpoint and GGUF maps."""

    architecture: Architecture
    model_class: Callable[[ModelConfig], nn.Module]
    read_config: Callable[[Mapping[str, Any], str], ModelConfig]
    weights: WeightMap
    gguf: GgufMap | None = None

    @property
    def name(self) -> str:
        return self.architecture.family
