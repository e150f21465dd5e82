"""Read a Hugging Face model folder: config.json, *.safetensors (sharded or not), tokenizer."""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import os
from collections.abc import Iterator

import torch

from loraplex.inference_server.model.checkpoint import Checkpoint, ModelSource, check_names_and_shapes
from loraplex.inference_server.model.config import ModelConfig
from loraplex.inference_server.model.registry import config_from_hf
from loraplex.inference_server.model.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# Buffers some old checkpoints carry that are recomputed, never loaded.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def open_checkpoint(source: ModelSource, dtype: torch.dtype) -> Checkpoint:
    """Parse config and tokenizer, check every tensor's name and shape; stream tensors later."""
    folder = os.fspath(source.path)
    config = read_config(folder)
    files = weight_files(folder)
    config = _untied_if_different(config, files, folder)
    index = _tensor_index(files, config)
    check_names_and_shapes({n: s for n, (_, s) in index.items()}, config, folder)
    tokenizer = Tokenizer.from_folder(folder, extra_eos_ids=config.eos_token_ids)

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for file in files:
            names = [n for n, (f, _) in index.items() if f == file]
            with _open(file) as handle:
                for name in names:
                    try:
                        tensor = handle.get_tensor(name)
                    except Exception as exc:
                        raise ValueError(f"{file}: cannot read tensor {name!r}: {exc}") from exc
                    yield name, tensor.to(dtype)

    return Checkpoint(config=config, tokenizer=tokenizer, tensors=stream, num_tensors=len(index),
                      dtype=dtype, description=os.path.basename(os.path.normpath(folder)))


def read_config(folder: str) -> ModelConfig:
    """config.json -> ModelConfig (unsupported architecture: ValueError naming it)."""
    path = os.path.join(folder, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"{folder}: missing config.json; a Hugging Face model folder needs one")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: expected a JSON object")
    try:
        return config_from_hf(cfg, name=os.path.basename(os.path.normpath(folder)))
    except (ValueError, KeyError, TypeError) as exc:
        what = f"missing required field {exc.args[0]!r}" if isinstance(exc, KeyError) else str(exc)
        raise ValueError(f"{path}: {what}") from exc


def weight_files(folder: str) -> list[str]:
    """The safetensors files holding the weights; pickle checkpoints are refused."""
    index_path = os.path.join(folder, "model.safetensors.index.json")
    if os.path.isfile(index_path):
        try:
            with open(index_path, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{index_path}: unreadable shard index: {exc}") from exc
        files = [os.path.join(folder, name) for name in sorted(set(weight_map.values()))]
        for file in files:
            if not os.path.isfile(file):
                raise ValueError(f"{index_path}: lists shard {os.path.basename(file)!r}, which is missing")
        return files
    single = os.path.join(folder, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    # consolidated*.safetensors are Mistral's native format (other names), not HF's.
    files = sorted(f for f in glob.glob(os.path.join(folder, "*.safetensors"))
                   if not os.path.basename(f).startswith("consolidated"))
    if files:
        return files
    if glob.glob(os.path.join(folder, "*.bin")) or glob.glob(os.path.join(folder, "*.pt")):
        raise ValueError(
            f"{folder}: only pickle weights (*.bin / *.pt) found; loraplex loads safetensors only "
            "(pickle can run code). Convert with save_pretrained(..., safe_serialization=True)"
        )
    raise ValueError(f"{folder}: no *.safetensors weight files")


def _open(file: str):  # noqa: ANN202 - safetensors' handle type is not public
    from safetensors import safe_open

    try:
        return safe_open(file, framework="pt", device="cpu")
    except Exception as exc:  # SafetensorError, OSError, ...
        raise ValueError(f"{file}: corrupt or unreadable safetensors file: {exc}") from exc


def _untied_if_different(config: ModelConfig, files: list[str], folder: str) -> ModelConfig:
    """A config that ties lm_head to the embeddings while the checkpoint holds an lm_head.weight of
    other values: as transformers loads it, the two stay apart (the checkpoint's lm_head is used).
    Equal values, or no lm_head.weight: tied as the config says."""
    if not config.tie_word_embeddings:
        return config
    found: dict[str, str] = {}
    for file in files:
        with _open(file) as handle:
            found.update({n: file for n in handle.keys() if n in ("lm_head.weight", "model.embed_tokens.weight")})
    if len(found) < 2:
        return config
    tensors = {}
    for name, file in found.items():
        with _open(file) as handle:
            tensors[name] = handle.get_tensor(name)
    head, embed = tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]
    if head.shape == embed.shape and torch.equal(head, embed):
        return config
    log.warning("%s: config.json ties lm_head to the embeddings, but the checkpoint's lm_head.weight differs from "
                "them: kept apart, as transformers loads it (set tie_word_embeddings false to say so)", folder)
    return dataclasses.replace(config, tie_word_embeddings=False)


def _tensor_index(files: list[str], config: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """HF name -> (file, shape) from the safetensors headers; tied lm_head and buffers dropped."""
    index: dict[str, tuple[str, tuple[int, ...]]] = {}
    for file in files:
        with _open(file) as handle:
            for name in handle.keys():
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    continue
                if name in index:
                    raise ValueError(f"{file}: tensor {name!r} also appears in {index[name][0]}")
                try:
                    shape = tuple(handle.get_slice(name).get_shape())
                except Exception as exc:
                    raise ValueError(f"{file}: corrupt header entry for tensor {name!r}: {exc}") from exc
                index[name] = (file, shape)
    return index
