"""Read a GGUF file (llama.cpp's format): config and tokenizer from its metadata, tensors
dequantized at load and mapped back to Hugging Face names and layout.

Two things differ from a HF checkpoint. (1) GGUF lists a tensor's shape innermost-first
(``[in, out]``); the numpy view the ``gguf`` package gives is already row-major
``[out, in]``, i.e. the HF layout. (2) llama.cpp's converter permutes the rows of q_proj and
k_proj of Llama-architecture models (per head: interleaved rotary pairs instead of halves);
we undo it exactly as transformers' GGUF loader does (``LlamaTensorProcessor``).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from loraplex.inference_server.model.checkpoint import Checkpoint, ModelSource, check_names_and_shapes
from loraplex.inference_server.model.config import ModelConfig
from loraplex.inference_server.model.tokenizer import Tokenizer

# GGUF general.architecture -> our model_type; q/k un-permute applies to "llama" only
# (llama.cpp converts Mistral as "llama" too; its Qwen2 converter does not permute).
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2"}
_PERMUTED_ARCHITECTURES = frozenset({"llama"})
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")
_ROPE_FREQS = "rope_freqs.weight"


def open_checkpoint(source: ModelSource, dtype: torch.dtype) -> Checkpoint:
    """Parse the metadata now (config, tokenizer, names and shapes); dequantize tensors later."""
    path = os.fspath(source.path)
    reader = _reader(path)
    config = read_config(reader, path)
    shapes = {hf_name(t.name, path): tuple(int(d) for d in reversed(t.shape))
              for t in reader.tensors if t.name != _ROPE_FREQS}
    check_names_and_shapes(shapes, config, path)
    tokenizer = Tokenizer.from_gguf(path, extra_eos_ids=config.eos_token_ids)
    del reader

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        from gguf.quants import dequantize

        reader = _reader(path)
        arch = _architecture(reader, path)
        for t in reader.tensors:
            if t.name == _ROPE_FREQS:
                continue
            try:
                weights = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
            except NotImplementedError as exc:
                raise ValueError(f"{path}: tensor {t.name}: unsupported GGUF type {t.tensor_type.name}") from exc
            name = hf_name(t.name, path)
            if arch in _PERMUTED_ARCHITECTURES:
                weights = _unpermute_qk(weights, name, config)
            yield name, weights.to(dtype)

    return Checkpoint(config=config, tokenizer=tokenizer, tensors=stream, num_tensors=len(shapes),
                      dtype=dtype, description=os.path.basename(path))


def read_config(reader: Any, path: str) -> ModelConfig:
    """ModelConfig from the ``{arch}.*`` and ``tokenizer.ggml.*`` metadata keys."""
    arch = _architecture(reader, path)
    meta = lambda key, default=None: _field(reader, f"{arch}.{key}", default)  # noqa: E731
    hidden, heads = meta("embedding_length"), meta("attention.head_count")
    if hidden is None or heads is None or meta("block_count") is None:
        raise ValueError(f"{path}: GGUF metadata lacks {arch}.embedding_length/block_count/attention.head_count")
    vocab = meta("vocab_size") or _array_len(reader, "tokenizer.ggml.tokens")
    if not vocab:
        raise ValueError(f"{path}: GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
    head_dim = meta("attention.key_length") or (meta("rope.dimension_count") if arch == "llama" else None)
    title = str(_field(reader, "general.name", os.path.basename(path)))
    model_type = GGUF_ARCHITECTURES[arch]
    if model_type == "llama" and "mistral" in f"{title} {os.path.basename(path)}".lower():
        model_type = "mistral"  # what transformers does; the module tree is the same
    tensor_names = {t.name for t in reader.tensors}
    eos = [_field(reader, k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    return ModelConfig(
        model_type=model_type,
        vocab_size=int(vocab),
        hidden_size=int(hidden),
        intermediate_size=int(meta("feed_forward_length", 0)),
        num_layers=int(meta("block_count")),
        num_heads=int(heads),
        num_kv_heads=int(meta("attention.head_count_kv") or heads),
        head_dim=int(head_dim or hidden // heads),
        rms_norm_eps=float(meta("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta("rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(reader, arch, path),
        max_position_embeddings=int(meta("context_length", 4096)),
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias="blk.0.attn_q.bias" in tensor_names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
        name=served_name(path),
    )


# a quantization or precision label at the end of a GGUF file's stem: .Q4_1, -Q4_K_M, .IQ3_XS, .f16
_QUANT_SUFFIX = re.compile(r"[.\-_](?:I?Q\d+(?:_[A-Z0-9]+)*|F16|F32|BF16|FP16)$", re.IGNORECASE)


def served_name(path: str) -> str:
    """The name a user knows a GGUF model by: its file name less ``.gguf`` and the quantization
    label (SmolLM2-135M-Instruct.Q4_1.gguf -> SmolLM2-135M-Instruct). The metadata's
    general.name is a converter's title ("Smollm2 135M 8k Lc100K Mix1 Ep2") nobody asks for."""
    stem = os.path.basename(path)
    stem = stem[: -len(".gguf")] if stem.lower().endswith(".gguf") else stem
    return _QUANT_SUFFIX.sub("", stem) or stem


def hf_name(gguf_name: str, path: str = "GGUF") -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'."""
    base, _, kind = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES and kind == "weight":
        return f"{_GLOBAL_NAMES[base]}.weight"
    m = _BLOCK.match(gguf_name)
    if m is None or m.group(2) not in _BLOCK_NAMES:
        raise ValueError(f"{path}: unexpected GGUF tensor {gguf_name!r} for a Llama-family model")
    return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"


def unpermute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Inverse of llama.cpp's ``permute``: rows [h, 2, d/2] -> [h, d/2, 2] per head, back to HF."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _unpermute_qk(w: torch.Tensor, name: str, config: ModelConfig) -> torch.Tensor:
    if ".self_attn.q_proj." in name:
        return unpermute(w, config.num_heads)
    if ".self_attn.k_proj." in name:
        return unpermute(w, config.num_kv_heads)
    return w


def _reader(path: str) -> Any:
    from gguf import GGUFReader

    if not os.path.isfile(path):
        raise ValueError(f"{path}: no such GGUF file")
    try:
        return GGUFReader(path)
    except Exception as exc:  # ValueError, struct errors, numpy errors on truncated files
        raise ValueError(f"{path}: not a readable GGUF file: {exc}") from exc


def _architecture(reader: Any, path: str) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(
            f"{path}: unsupported GGUF architecture {arch!r}; supported: {sorted(GGUF_ARCHITECTURES)}"
        )
    return arch


def _field(reader: Any, key: str, default: Any = None) -> Any:
    """A scalar or string metadata value, or ``default`` when the key is absent."""
    from gguf import GGUFValueType

    field = reader.fields.get(key)
    if field is None or not field.data:
        return default
    kind = field.types[0]
    if kind == GGUFValueType.ARRAY:
        raise ValueError(f"GGUF metadata {key} is an array, expected a scalar")
    part = field.parts[field.data[0]]
    if kind == GGUFValueType.STRING:
        return bytes(part).decode("utf-8")
    return part[0].item()


def _array_len(reader: Any, key: str) -> int:
    field = reader.fields.get(key)
    return len(field.data) if field is not None else 0


def _rope_scaling(reader: Any, arch: str, path: str) -> dict[str, Any] | None:
    """HF-style rope_scaling from ``{arch}.rope.scaling.*`` or a llama3 ``rope_freqs`` tensor."""
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind not in (None, "none"):
        scaling: dict[str, Any] = {"rope_type": kind, "factor": float(_field(reader, f"{arch}.rope.scaling.factor", 1.0))}
        original = _field(reader, f"{arch}.rope.scaling.original_context_length")
        if original is not None:
            scaling["original_max_position_embeddings"] = int(original)
        return scaling
    freqs = next((t for t in reader.tensors if t.name == _ROPE_FREQS), None)
    if freqs is None:
        return None
    factors = np.asarray(freqs.data, dtype=np.float64).reshape(-1)
    return _llama3_scaling(factors, float(_field(reader, f"{arch}.rope.freq_base", 10000.0)), path)


def _llama3_scaling(factors: np.ndarray, theta: float, path: str) -> dict[str, Any]:
    """Recover Llama 3.x rope_scaling from llama.cpp's per-frequency divisors (rope_freqs)."""
    head_dim = 2 * len(factors)
    factor = float(factors.max())
    for original in (8192, 4096, 16384, 32768):
        low, high = 1.0, 4.0
        wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)
        smooth = (original / wavelen - low) / (high - low)
        expected = np.where(wavelen < original / high, 1.0,
                            np.where(wavelen > original / low, factor, 1 / ((1 - smooth) / factor + smooth)))
        if np.allclose(expected, factors, rtol=1e-4):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low,
                    "high_freq_factor": high, "original_max_position_embeddings": original}
    raise ValueError(f"{path}: rope_freqs.weight does not match Llama 3 rope scaling; unsupported rope variant")
