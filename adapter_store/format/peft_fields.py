"""PEFT's LoraConfig fields (peft 0.21), each with what loraplex does with it.

An adapter_config.json that leaves a field out means PEFT's default for it, as PEFT itself reads
the file: loraplex must never guess another (it once read a missing lora_alpha as r, so at r=16
an adapter acted twice as strong as in PEFT). Every field is in exactly one table below;
tests/store/test_peft_defaults.py holds the tables against the installed peft, so a peft release with
a new field or a changed default fails there until it is placed here.
"""

from __future__ import annotations

from types import MappingProxyType

# The fields validation reads, with the value PEFT gives one left out.
PEFT_DEFAULTS = MappingProxyType({
    "r": 8,
    "lora_alpha": 8,
    "use_rslora": False,
    "target_modules": None,  # PEFT then adapts its default modules for the architecture (architectures.py)
    "exclude_modules": None,
    "layers_to_transform": None,
    "layers_pattern": None,
    "rank_pattern": {},
    "alpha_pattern": {},
    "init_lora_weights": True,  # read only to refuse the inits that change the base model (below)
})


# Features a plain LoRA on a shared base model cannot serve: field -> (PEFT's default, what the
# field turns on). A config that sets one to anything but the default is refused, naming it.
UNSUPPORTED = MappingProxyType({
    "use_dora": (False, "DoRA"),
    "modules_to_save": (None, "fully trained extra modules"),
    "bias": ("none", "bias training"),
    "lora_bias": (False, "a bias on lora_B"),
    "fan_in_fan_out": (False, "Conv1D-style (fan_in, fan_out) weights"),
    "target_parameters": (None, "LoRA on parameters rather than modules"),
    "trainable_token_indices": (None, "trainable token embeddings"),
    "layer_replication": (None, "replicated base layers"),
    "alora_invocation_tokens": (None, "Activated LoRA (aLoRA)"),
    "use_qalora": (False, "QALoRA (input pooling, for GPTQ bases)"),
    "velora_config": (None, "VeLoRA"),
    "monteclora_config": (None, "MonteCLoRA"),
    "use_bdlora": (None, "block-diagonal LoRA (BD-LoRA)"),
    "arrow_config": (None, "Arrow routing"),
    "kasa_config": (None, "KaSA (it truncates the base weights)"),
    "astra_config": (None, "Astra-built adapter layers (peft 0.22)"),
})

# init_lora_weights values under which PEFT, loading the adapter, changes the base model's
# weights (the adapter was trained against that changed base): prefixes, as PEFT tests them.
BASE_CHANGING_INITS = ("pissa", "corda", "olora", "loftq")

# Fields that do not change what a loaded adapter computes: metadata, training, and the
# initialisation of weights that the adapter file then overwrites.
IGNORED = frozenset({
    "task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision",
    "inference_mode", "lora_dropout", "megatron_config", "megatron_core", "loftq_config", "eva_config",
    "corda_config", "lora_ga_config", "qalora_group_size", "runtime_config", "ensure_weight_tying",
})


def is_set(field_name: str, value: object) -> bool:
    """Whether an UNSUPPORTED field's value turns its feature on, as PEFT decides it: a sub-config
    is on once given at all (PEFT builds one from ``{}``), a flag or list when truthy."""
    default, _ = UNSUPPORTED[field_name]
    if field_name == "bias":
        return value != default
    if field_name.endswith("_config") or field_name == "use_bdlora":
        return value is not None
    return bool(value)
