"""loraplex reads adapter_config.json as the installed peft does, fields left out included.

Each case writes a config that leaves fields out (as a hand-written config or an older peft's
does), with the weights peft itself makes for it; then peft loads the folder onto a tiny Llama
and loraplex parses it, and what every adapted module adds to its projection's output is
compared: peft's LoRA layer minus its base layer, against loraplex's scale x @ A^T @ B^T. Where
peft would leave weights unused (a module it does not adapt), loraplex refuses the adapter.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from loraplex.adapter_store.errors import AdapterValidationError
from loraplex.adapter_store.format.architectures import MODEL_TYPES, for_model_type
from loraplex.adapter_store.format.peft_fields import IGNORED, PEFT_DEFAULTS, UNSUPPORTED
from loraplex.adapter_store.format.peft_format import parse_adapter_files
from loraplex.inference_server.model.config import ModelConfig
from loraplex.inference_server.model.registry import config_from_hf

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

TINY = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=64, max_position_embeddings=64)
_NAME = re.compile(r"model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+_proj)$")


@pytest.fixture(scope="module")
def tiny_llama():
    with torch.random.fork_rng():
        torch.manual_seed(3)
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).eval()


@pytest.fixture(scope="module")
def base() -> ModelConfig:
    return config_from_hf(transformers.LlamaConfig(**TINY).to_dict(), name="tiny")


def _fields_default(f: dataclasses.Field) -> object:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def _adapter(model, out: Path, written: dict, trained: dict | None = None) -> Path:
    """A folder whose adapter_config.json is ``written`` and whose weights peft made (random,
    non-zero) for LoraConfig(**trained), ``written`` by default."""
    peft_model = peft.get_peft_model(copy.deepcopy(model), peft.LoraConfig(**(trained or written)))
    gen = torch.Generator().manual_seed(len(json.dumps(written)))
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    peft_model.save_pretrained(out, safe_serialization=True)
    (out / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", **written}))
    return out


def _inputs(module: torch.nn.Module, key: tuple[int, str]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(key[0] * 10 + len(key[1]))
    return torch.randn(3, module.in_features, generator=gen)


def peft_deltas(model, folder: Path) -> dict[tuple[int, str], torch.Tensor]:
    """What each module peft adapts adds to its output for fixed inputs."""
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(model), folder).eval()
    out = {}
    with torch.no_grad():
        for name, module in loaded.base_model.model.named_modules():
            m = _NAME.search(name)
            if m and isinstance(module, peft.tuners.lora.LoraLayer):
                key = (int(m.group(1)), m.group(2))
                x = _inputs(module.base_layer, key)
                out[key] = module(x) - module.base_layer(x)
    return out


def loraplex_deltas(model, folder: Path, base: ModelConfig) -> dict[tuple[int, str], torch.Tensor]:
    files = {n: (folder / n).read_bytes() for n in ("adapter_config.json", "adapter_model.safetensors")}
    spec = parse_adapter_files(files, base)
    weights = load_file(folder / "adapter_model.safetensors")
    projections = dict(model.named_modules())
    out = {}
    for m in spec.modules:
        parent = "self_attn" if m.module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
        x = _inputs(projections[f"model.layers.{m.layer}.{parent}.{m.module}"], (m.layer, m.module))
        out[(m.layer, m.module)] = m.scale * (x @ weights[m.a_name].T @ weights[m.b_name].T)
    return out


ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SAME_AS_PEFT = {
    "no lora_alpha (peft: 8, not r)": {"r": 16, "target_modules": ["q_proj", "v_proj"]},
    "no r (peft: 8)": {"lora_alpha": 16, "target_modules": ["q_proj", "down_proj"]},
    "no r, no lora_alpha": {"target_modules": ["o_proj"]},
    "no target_modules (peft: q_proj, v_proj)": {"r": 4, "lora_alpha": 8},
    "nothing but peft_type": {},
    "rsLoRA without lora_alpha": {"r": 16, "use_rslora": True, "target_modules": ["k_proj"]},
    "rank_pattern without lora_alpha": {"r": 8, "rank_pattern": {"q_proj": 4}, "target_modules": ["q_proj", "v_proj"]},
    "alpha_pattern without r": {"alpha_pattern": {"v_proj": 32}, "target_modules": ["q_proj", "v_proj"]},
    "exclude_modules": {"r": 4, "target_modules": ALL, "exclude_modules": ["up_proj", "k_proj"]},
    "exclude_modules as a pattern": {"r": 4, "target_modules": ALL, "exclude_modules": r".*\.1\.mlp\..*"},
    "layers_pattern": {"r": 4, "target_modules": ["q_proj"], "layers_to_transform": [1], "layers_pattern": "layers"},
    "all-linear in capitals": {"r": 4, "target_modules": "ALL-LINEAR"},
    "target_modules as a pattern": {"r": 2, "target_modules": r".*\.(gate|v)_proj"},
    "MiCA init (plain LoRA at inference)": {"r": 4, "target_modules": ["q_proj"], "init_lora_weights": "mica"},
}


@pytest.mark.parametrize("written", SAME_AS_PEFT.values(), ids=SAME_AS_PEFT.keys())
def test_loraplex_reads_a_config_as_peft_does(tiny_llama, base, tmp_path, written) -> None:
    folder = _adapter(tiny_llama, tmp_path / "a", written)
    expected = peft_deltas(tiny_llama, folder)
    got = loraplex_deltas(tiny_llama, folder, base)
    assert expected and sorted(got) == sorted(expected)
    for key, delta in expected.items():
        torch.testing.assert_close(got[key], delta, msg=lambda m, key=key: f"{key}: {m}")


# (what the config says, what the weights were trained with, a module peft leaves unused, the error)
UNUSED_BY_PEFT = {
    "no target_modules, k_proj weights": (
        {"r": 4}, {"r": 4, "target_modules": ["q_proj", "k_proj", "v_proj"]}, (0, "k_proj"),
        r"layers\.0\.k_proj: has weights but is not among target_modules \['q_proj', 'v_proj'\]"),
    "an empty target_modules": (
        {"r": 4, "target_modules": []}, {"r": 4, "target_modules": ["q_proj"]}, (0, "q_proj"),
        r"layers\.0\.q_proj: has weights but is not among target_modules \[\]"),
    "exclude_modules": (
        {"r": 4, "target_modules": ["q_proj", "v_proj"], "exclude_modules": ["v_proj"]},
        {"r": 4, "target_modules": ["q_proj", "v_proj"]}, (1, "v_proj"),
        r"layers\.0\.v_proj: has weights but exclude_modules \['v_proj'\] leaves it out"),
}


@pytest.mark.parametrize("written, trained, unused, error", UNUSED_BY_PEFT.values(), ids=UNUSED_BY_PEFT.keys())
def test_weights_peft_would_not_use_are_refused(tiny_llama, base, tmp_path, written, trained, unused, error) -> None:
    folder = _adapter(tiny_llama, tmp_path / "a", written, trained)
    try:
        used = peft_deltas(tiny_llama, folder)
    except peft.utils.error.NoMatchingPeftModuleError:  # peft adapts no module at all
        used = {}
    assert unused not in used
    with pytest.raises(AdapterValidationError, match=error):
        loraplex_deltas(tiny_llama, folder, base)


def test_every_field_of_the_installed_lora_config_is_placed_and_its_default_is_peft_s() -> None:
    fields = {f.name: f for f in dataclasses.fields(peft.LoraConfig)}
    placed = [*PEFT_DEFAULTS, *UNSUPPORTED, *IGNORED]
    assert len(placed) == len(set(placed)), "a field is in two tables"
    newer = {"astra_config"} if tuple(map(int, peft.__version__.split(".")[:2])) < (0, 22) else set()  # peft 0.22's
    assert set(fields) == set(placed) - newer, \
        f"new in peft: {set(fields) - set(placed)}; gone: {set(placed) - newer - set(fields)}"
    for name, default in PEFT_DEFAULTS.items():
        assert _fields_default(fields[name]) == default, name
    for name, (default, _) in ((n, v) for n, v in UNSUPPORTED.items() if n not in newer):
        assert _fields_default(fields[name]) == default, name
    variants = {n for n, f in fields.items() if f.metadata.get("is_lora_variant")}
    assert variants <= set(UNSUPPORTED), f"LoRA variants loraplex would serve as plain LoRA: {variants - set(UNSUPPORTED)}"
    mapping = peft.utils.constants.TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING
    for model_type in MODEL_TYPES:  # PEFT's default targets, or none (PEFT then refuses the config)
        ours = for_model_type(model_type).peft_defaults
        assert sorted(mapping.get(model_type) or []) == sorted(ours or []), model_type


def _turned_on(name: str) -> object:
    default, _ = UNSUPPORTED[name]
    if default is False:
        return True
    if name == "bias":
        return "all"
    return {} if name.endswith("_config") or name == "use_bdlora" else [1]


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_a_feature_loraplex_cannot_serve_is_refused_naming_its_field(tiny_llama, base, tmp_path, name) -> None:
    folder = _adapter(tiny_llama, tmp_path / "a", {"r": 4, "target_modules": ["q_proj"]})
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, name: _turned_on(name)}))
    with pytest.raises(AdapterValidationError, match=f"^{name}: unsupported adapter features: ") as info:
        loraplex_deltas(tiny_llama, folder, base)
    assert info.value.field == name


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_4", "corda", "olora", "loftq"])
def test_an_init_that_changes_the_base_weights_is_refused(tiny_llama, base, tmp_path, init) -> None:
    folder = _adapter(tiny_llama, tmp_path / "a", {"r": 4, "target_modules": ["q_proj"]})
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "init_lora_weights": init}))
    with pytest.raises(AdapterValidationError, match="^init_lora_weights: .*changes the base model's weights"):
        loraplex_deltas(tiny_llama, folder, base)
