"""Read a GGUF file (llama.cpp's format): config and tokenizer from its metadata, tensors
dequantized at load and mapped back to Hugging Face names and layout.

What differs from a HF checkpoint. (1) GGUF lists a tensor's shape innermost-first
(``[in, out]``); the numpy view the ``gguf`` package gives is already row-major
``[out, in]``, i.e. the HF layout. (2) llama.cpp's converter permutes the rows of q_proj and
k_proj of Llama-architecture models (per head: interleaved rotary pairs instead of halves);
we undo it exactly as transformers' GGUF loader does (``LlamaTensorProcessor``). (3) Its Gemma
converters store norm weights as 1 + w; we take the 1 off again (``Gemma2TensorProcessor``).
Which names and metadata a family's files use is its ``GgufMap`` (family.py).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch

from loraplex.inference_server.model.checkpoint import Checkpoint, ModelSource, check_names_and_shapes
from loraplex.inference_server.model.config import ModelConfig
from loraplex.inference_server.model.family import Family
from loraplex.inference_server.model.registry import gguf_family
from loraplex.inference_server.model.tokenizer import Tokenizer

# GGUF metadata every family names alike: {arch}.<key> -> the config.json field
_SHARED_METADATA = {
    "context_length": "max_position_embeddings",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "embedding_length": "hidden_size",
    "rope.freq_base": "rope_theta",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}
_GLOBAL_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
# GGUF block tensors every family names alike (a family's GgufMap.blocks adds or overrides)
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
    arch, family = _family(reader, path)
    config = read_config(reader, path)
    blocks = {**_BLOCK_NAMES, **family.gguf.blocks}
    shapes = {hf_name(t.name, path, blocks): tuple(int(d) for d in reversed(t.shape))
              for t in reader.tensors if t.name != _ROPE_FREQS}
    check_names_and_shapes(shapes, config, path)
    tokenizer = Tokenizer.from_gguf(path, extra_eos_ids=config.eos_token_ids)
    del reader

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        from gguf.quants import dequantize

        reader = _reader(path)
        for t in reader.tensors:
            if t.name == _ROPE_FREQS:
                continue
            try:
                weights = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
            except NotImplementedError as exc:
                raise ValueError(f"{path}: tensor {t.name}: unsupported GGUF type {t.tensor_type.name}") from exc
            name = hf_name(t.name, path, blocks)
            if arch in family.gguf.permute_qk:
                weights = _unpermute_qk(weights, name, config)
            if family.gguf.norm_offset and name.endswith("norm.weight"):
                weights = weights - family.gguf.norm_offset  # transformers' GGUF reader does the same
            yield name, weights.to(dtype)

    return Checkpoint(config=config, tokenizer=tokenizer, tensors=stream, num_tensors=len(shapes),
                      dtype=dtype, description=os.path.basename(path))


def _q_head_dim(reader: Any, cfg: Mapping[str, Any]) -> int | None:
    """The head size the first layer's q projection implies (its elements over the hidden size and
    the heads), or None without that tensor."""
    q = next((t for t in reader.tensors if t.name == "blk.0.attn_q.weight"), None)
    if q is None:
        return None
    return int(q.n_elements) // cfg["hidden_size"] // cfg["num_attention_heads"] or None


def read_config(reader: Any, path: str) -> ModelConfig:
    """ModelConfig from the ``{arch}.*`` and ``tokenizer.ggml.*`` metadata keys: translated to the
    config.json fields they stand for (as transformers' GGUF reader does), then read by the family."""
    arch, family = _family(reader, path)
    cfg: dict[str, Any] = {}
    for key, hf_field in {**_SHARED_METADATA, **family.gguf.metadata}.items():
        value = _field(reader, f"{arch}.{key}")
        if value is not None:
            cfg[hf_field] = value
    for required in ("hidden_size", "num_hidden_layers", "num_attention_heads"):
        if required not in cfg:
            raise ValueError(f"{path}: GGUF metadata lacks {arch}.embedding_length/block_count/attention.head_count")
    cfg.setdefault("vocab_size", _array_len(reader, "tokenizer.ggml.tokens"))
    if not cfg["vocab_size"]:
        raise ValueError(f"{path}: GGUF metadata has neither {arch}.vocab_size nor tokenizer.ggml.tokens")
    rope_dims = _field(reader, f"{arch}.rope.dimension_count")
    if "head_dim" not in cfg and arch == "llama":  # no key_length: q_proj's rows over the heads say it
        cfg["head_dim"] = _q_head_dim(reader, cfg) or rope_dims or cfg["hidden_size"] // cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    if rope_dims is not None and rope_dims != head_dim:
        raise ValueError(f"{path}: {arch}.rope.dimension_count {rope_dims} is not the head size {head_dim}: RoPE "
                         "over part of each head (partial rotary) is not supported")
    experts = _field(reader, f"{arch}.expert_count")
    if experts:
        raise ValueError(f"{path}: {arch}.expert_count {experts}: mixture-of-experts models are not supported")
    cfg.setdefault("intermediate_size", 0)
    title = str(_field(reader, "general.name", os.path.basename(path)))
    model_type = family.gguf.architectures[arch]
    if model_type == "llama" and "mistral" in f"{title} {os.path.basename(path)}".lower():
        model_type = "mistral"  # what transformers does; the module tree is the same
    tensor_names = {t.name for t in reader.tensors}
    eos = [_field(reader, k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
    eos_ids = list(dict.fromkeys(int(e) for e in eos if e is not None))
    cfg.update(model_type=model_type, rope_scaling=_rope_scaling(reader, arch, path),
               tie_word_embeddings="output.weight" not in tensor_names,
               attention_bias="blk.0.attn_q.bias" in tensor_names,
               bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
               eos_token_id=eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None))
    try:
        return family.read_config(cfg, served_name(path))
    except (ValueError, KeyError) as exc:
        raise ValueError(f"{path}: {exc}") from exc


# a quantization or precision label at the end of a GGUF file's stem: .Q4_1, -Q4_K_M, .IQ3_XS, .f16
_QUANT_SUFFIX = re.compile(r"[.\-_](?:I?Q\d+(?:_[A-Z0-9]+)*|F16|F32|BF16|FP16)$", re.IGNORECASE)


def served_name(path: str) -> str:
    """The name a user knows a GGUF model by: its file name less ``.gguf`` and the quantization
    label (SmolLM2-135M-Instruct.Q4_1.gguf -> SmolLM2-135M-Instruct). The metadata's
    general.name is a converter's title ("Smollm2 135M 8k Lc100K Mix1 Ep2") nobody asks for."""
    stem = os.path.basename(path)
    stem = stem[: -len(".gguf")] if stem.lower().endswith(".gguf") else stem
    return _QUANT_SUFFIX.sub("", stem) or stem


def hf_name(gguf_name: str, path: str = "GGUF", blocks: dict[str, str] | None = None) -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight' (``blocks``: the
    family's block names; the shared ones by default)."""
    blocks = _BLOCK_NAMES if blocks is None else blocks
    base, _, kind = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES and kind == "weight":
        return f"{_GLOBAL_NAMES[base]}.weight"
    m = _BLOCK.match(gguf_name)
    if m is None or m.group(2) not in blocks:
        raise ValueError(f"{path}: unexpected GGUF tensor {gguf_name!r} for this model family")
    return f"model.layers.{m.group(1)}.{blocks[m.group(2)]}.{m.group(3)}"


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


def _family(reader: Any, path: str) -> tuple[str, Family]:
    """The file's ``general.architecture`` and the family whose GGUF files it names."""
    arch = _field(reader, "general.architecture")
    try:
        return arch, gguf_family(arch)
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None


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
