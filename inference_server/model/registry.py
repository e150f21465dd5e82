"""The model families loraplex serves, by model type: each family's file declares one ``Family``
(family.py); this is the one place that lists them. A model type, architecture or GGUF
architecture no family serves is refused with the supported ones listed."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from loraplex.adapter_store.format.architectures import model_type_of
from loraplex.inference_server.model import gemma, llama, phi3, qwen3
from loraplex.inference_server.model.config import ModelConfig
from loraplex.inference_server.model.family import Family

FAMILIES: tuple[Family, ...] = (llama.FAMILY, qwen3.FAMILY, gemma.FAMILY, phi3.FAMILY)
_BY_MODEL_TYPE = {m: f for f in FAMILIES for m in f.architecture.model_types}
_BY_GGUF = {a: f for f in FAMILIES if f.gguf is not None for a in f.gguf.architectures}


def family_of(model_type: str) -> Family:
    """The family serving ``model_type``; ValueError listing the supported model types."""
    if model_type not in _BY_MODEL_TYPE:
        raise ValueError(f"unsupported model type {model_type!r}; supported: {sorted(_BY_MODEL_TYPE)}")
    return _BY_MODEL_TYPE[model_type]


def gguf_family(architecture: str) -> Family:
    """The family whose GGUF files say ``general.architecture = architecture``."""
    if architecture not in _BY_GGUF:
        raise ValueError(f"unsupported GGUF architecture {architecture!r}; supported: {sorted(_BY_GGUF)}")
    return _BY_GGUF[architecture]


def config_from_hf(cfg: Mapping[str, Any], name: str = "model") -> ModelConfig:
    """A Hugging Face config.json (as a dict) read by its family; ValueError naming what is wrong."""
    return family_of(model_type_of(cfg)).read_config(cfg, name)
