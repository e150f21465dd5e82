"""Adapters across model families: the store (no torch, a config.json) and the server (its
ModelConfig) check an adapter against the same table of targets and shapes; an adapter made for
another family or another size is refused naming the module and the shapes; config fields a
family does not implement are refused at start by name."""

from __future__ import annotations

import pytest
import torch

from adapter_bytes import adapter_files
from loraplex.adapter_store.errors import AdapterValidationError
from loraplex.adapter_store.format.architectures import ARCHITECTURES, MODEL_TYPES, Slot
from loraplex.adapter_store.format.base_shapes import HFBaseShapes
from loraplex.adapter_store.format.peft_format import parse_adapter_files
from loraplex.inference_server.lora.pool.packing import plan_layout
from loraplex.inference_server.model.registry import FAMILIES, config_from_hf

SIZES = dict(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
CONFIGS = {
    "llama": dict(SIZES, architectures=["LlamaForCausalLM"], model_type="llama"),
    "mistral": dict(SIZES, architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=64),
    "qwen2": dict(SIZES, architectures=["Qwen2ForCausalLM"], model_type="qwen2"),
    "qwen3": dict(SIZES, architectures=["Qwen3ForCausalLM"], model_type="qwen3", head_dim=16),
    "gemma2": dict(SIZES, architectures=["Gemma2ForCausalLM"], model_type="gemma2", head_dim=16,
                   hidden_activation="gelu_pytorch_tanh"),
    "gemma3_text": dict(SIZES, architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", head_dim=16,
                        hidden_activation="gelu_pytorch_tanh", sliding_window=64),
    "phi3": dict(SIZES, architectures=["Phi3ForCausalLM"], model_type="phi3"),
}


def test_every_family_of_the_table_is_served_and_every_served_family_is_in_the_table() -> None:
    assert sorted(MODEL_TYPES) == sorted(CONFIGS)
    assert [f.architecture for f in FAMILIES] == list(ARCHITECTURES)


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_the_store_and_the_server_see_the_same_targets_and_shapes(model_type: str) -> None:
    store, server = HFBaseShapes.from_hf(CONFIGS[model_type]), config_from_hf(CONFIGS[model_type])
    assert server.model_type == store.model_type == model_type
    assert store.architecture is server.architecture
    assert store.projection_shapes() == server.projection_shapes()
    assert store.num_layers == server.num_layers == 2


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_an_adapter_on_every_target_of_each_family_fits_its_base_and_packs(model_type: str) -> None:
    cfg = config_from_hf(CONFIGS[model_type])
    targets = list(cfg.projection_shapes())
    files = adapter_files(cfg, dict(r=8, lora_alpha=16, target_modules=targets), torch.float32, seed=1, shuffle=True)
    spec = parse_adapter_files(files, HFBaseShapes.from_hf(CONFIGS[model_type]))
    assert spec.target_modules == tuple(targets)
    layout = plan_layout(spec, cfg)
    assert layout.ranks == (8,) * len(targets)
    rows = cfg.architecture.slot_rows()
    assert set(rows) == set(Slot) and sum(count for _, count in rows.values()) == len(targets)


def test_phi3_adapters_target_the_fused_linears_whose_slices_are_q_k_v_and_gate_up() -> None:
    phi3, llama = config_from_hf(CONFIGS["phi3"]), config_from_hf(CONFIGS["llama"])
    assert list(phi3.projection_shapes()) == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]
    assert phi3.projection_shapes()["qkv_proj"] == (32, 32 + 2 * 16)
    assert phi3.architecture.slot_rows() == {Slot.QKV: (0, 1), Slot.O: (1, 1), Slot.GATE_UP: (2, 1),
                                              Slot.DOWN: (3, 1)}
    assert llama.architecture.slot_rows()[Slot.QKV] == (0, 3)


@pytest.mark.parametrize(("adapter_type", "base_type", "message"), [
    ("llama", "phi3", r"'base_model\.model\.model\.layers\.0\.self_attn\.q_proj\.lora_A\.weight' is not a LoRA A/B "
                      r"weight of a phi3 model's linear projections \(qkv_proj, o_proj, gate_up_proj, down_proj"),
    ("phi3", "gemma3_text", r"qkv_proj\.lora_A\.weight' is not a LoRA A/B weight of a gemma model's"),
])
def test_an_adapter_of_another_family_is_refused_naming_the_module(adapter_type: str, base_type: str,
                                                                   message: str) -> None:
    cfg = config_from_hf(CONFIGS[adapter_type])
    files = adapter_files(cfg, dict(r=4, lora_alpha=8, target_modules=list(cfg.projection_shapes())), torch.float32,
                          seed=2, shuffle=False)
    with pytest.raises(AdapterValidationError, match=message):
        parse_adapter_files(files, HFBaseShapes.from_hf(CONFIGS[base_type]))


def test_an_adapter_of_another_size_is_refused_naming_the_module_and_the_shapes() -> None:
    bigger = config_from_hf(dict(CONFIGS["gemma2"], hidden_size=64))
    files = adapter_files(bigger, dict(r=4, lora_alpha=8, target_modules=["q_proj"]), torch.float32, seed=3,
                          shuffle=False)
    with pytest.raises(AdapterValidationError,
                       match=r"q_proj\.lora_A\.weight' has shape \[4, 64\]: the base model's q_proj takes 32 inputs"):
        parse_adapter_files(files, HFBaseShapes.from_hf(CONFIGS["gemma2"]))


def test_phi3_has_no_default_targets_so_an_adapter_must_name_them() -> None:
    cfg = config_from_hf(CONFIGS["phi3"])
    files = adapter_files(cfg, dict(r=4, lora_alpha=8, target_modules=["qkv_proj"]), torch.float32, seed=4,
                          shuffle=False)
    files["adapter_config.json"] = b'{"peft_type": "LORA", "r": 4, "lora_alpha": 8}'
    with pytest.raises(AdapterValidationError, match="target_modules: left out of adapter_config.json, and PEFT has "
                                                     "no default target modules"):
        parse_adapter_files(files, HFBaseShapes.from_hf(CONFIGS["phi3"]))
    gemma = config_from_hf(CONFIGS["gemma2"])  # a family with defaults: q_proj and v_proj
    files = adapter_files(gemma, dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]), torch.float32, seed=4,
                          shuffle=False)
    files["adapter_config.json"] = b'{"peft_type": "LORA", "r": 4, "lora_alpha": 8}'
    assert parse_adapter_files(files, HFBaseShapes.from_hf(CONFIGS["gemma2"])).target_modules == ("q_proj", "v_proj")


@pytest.mark.parametrize(("change", "message"), [
    (dict(quantization_config={"quant_method": "gptq"}), r"quantization_config: quantized checkpoints \(gptq\)"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), r"rope_scaling: type 'yarn' is not supported; "
                                                              r"supported: \['default', 'linear', 'llama3'\]"),
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor 0.5"),
    (dict(hidden_act="gelu"), r"hidden_act: 'gelu' is not supported for llama models \(only 'silu'\)"),
    (dict(mlp_bias=True), "mlp_bias: True is not supported for llama models"),
    (dict(architectures=["FalconForCausalLM"], model_type="falcon"), r"unsupported architecture .*supported "
                                                                       r"architectures: \['LlamaForCausalLM'"),
    (dict(architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3"), "Gemma 3's multimodal checkpoint"),
])
def test_an_unimplemented_llama_config_field_is_refused_by_name(change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config_from_hf({**CONFIGS["llama"], **change})


@pytest.mark.parametrize(("model_type", "change", "message"), [
    ("phi3", dict(rope_scaling={"type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}),
     "rope_scaling: type 'longrope' is not supported"),
    ("gemma2", dict(hidden_activation="gelu"), r"hidden_activation: 'gelu' is not supported for Gemma models"),
    ("gemma3_text", dict(use_bidirectional_attention=True), "use_bidirectional_attention: True is not supported"),
    ("gemma3_text", dict(layer_types=["chunked_attention", "full_attention"]), "layer_types: .*chunked_attention"),
    ("qwen3", dict(hidden_act="relu"), r"hidden_act: 'relu' is not supported for qwen3 models"),
])
def test_an_unimplemented_family_field_is_refused_by_name(model_type: str, change: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        config_from_hf({**CONFIGS[model_type], **change})


def test_family_quirks_are_read_from_the_config() -> None:
    gemma2 = config_from_hf(CONFIGS["gemma2"])
    assert gemma2.attn_softcap == 50.0 and gemma2.final_softcap == 30.0 and gemma2.tie_word_embeddings
    assert gemma2.layer_windows == (4096, None) and gemma2.hidden_act == "gelu_tanh"
    assert gemma2.embed_scale == pytest.approx(32**0.5) and gemma2.attn_scale == pytest.approx(256**-0.5)
    gemma3 = config_from_hf({**CONFIGS["gemma3_text"], "num_hidden_layers": 7, "rope_theta": 1e6,
                             "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    assert gemma3.layer_windows == (64,) * 5 + (None, 64) and gemma3.qk_norm
    assert (gemma3.rope_theta, gemma3.local_rope_theta) == (1e6, 1e4)
    assert gemma3.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    qwen2 = config_from_hf({**CONFIGS["qwen2"], "use_sliding_window": True, "sliding_window": 32,
                            "max_window_layers": 1})
    assert qwen2.layer_windows == (None, 32) and qwen2.attention_bias
    assert config_from_hf({**CONFIGS["qwen2"], "sliding_window": 32}).layer_windows == ()  # use_sliding_window off
    assert config_from_hf(CONFIGS["mistral"]).layer_windows == (64, 64)
    assert config_from_hf(CONFIGS["qwen3"]).qk_norm and config_from_hf(CONFIGS["phi3"]).layer_windows == ()
