"""adapter_config.json as PEFT reads it: parsed, its fields type-checked, every field it leaves
out given PEFT's default (peft_fields.py), and the features loraplex cannot serve refused with
the config field that turns them on (the error's ``field``, e.g. ``use_dora``)."""

from __future__ import annotations

import copy
import json
import math

from loraplex.adapter_store.errors import AdapterValidationError
from loraplex.adapter_store.format.patterns import PatternMatcher
from loraplex.adapter_store.format.peft_fields import (BASE_CHANGING_INITS, IGNORED, PEFT_DEFAULTS, UNSUPPORTED,
                                                       is_set)

CONFIG_FILE = "adapter_config.json"


def read_config(raw: bytes, patterns: PatternMatcher | None) -> dict:
    """The config with PEFT's defaults filled in; ``patterns``: compile the patterns it holds
    (None when they were judged at upload). Raises AdapterValidationError naming the field."""
    try:
        config = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterValidationError(f"{CONFIG_FILE} is not valid JSON ({e})") from None
    except RecursionError:
        raise AdapterValidationError(f"{CONFIG_FILE} nests too deeply to be an adapter config") from None
    if not isinstance(config, dict):
        raise AdapterValidationError(f"{CONFIG_FILE} must hold a JSON object")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise AdapterValidationError(f"{CONFIG_FILE}: peft_type {peft_type} is not supported (only LORA)")
    if patterns is not None:  # judged as an upload (a stored adapter was judged when it came)
        reject_unknown(config)
    config = {**{k: copy.deepcopy(v) for k, v in PEFT_DEFAULTS.items()}, **config}
    if not _is_positive_int(config["r"]):
        raise AdapterValidationError(f"{CONFIG_FILE}: r must be a positive integer, got {config['r']!r}")
    if not _is_number(config["lora_alpha"]):
        raise AdapterValidationError(f"{CONFIG_FILE}: lora_alpha must be a number, got {config['lora_alpha']!r}")
    _check_module_fields(config, patterns)
    _check_pattern_tables(config, patterns)
    reject_unsupported(config)
    return config


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _is_positive_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def _names(value: object) -> bool:
    """A module-name field's value: a pattern string or a list of names (or left out)."""
    return value is None or isinstance(value, str) or (isinstance(value, list) and all(isinstance(t, str) for t in value))


def _check_module_fields(config: dict, patterns: PatternMatcher | None) -> None:
    """target_modules, exclude_modules, layers_to_transform and layers_pattern have the types PEFT
    writes and the combinations PEFT accepts (its LoraConfig refuses the others)."""
    for field_name in ("target_modules", "exclude_modules", "layers_pattern"):
        value = config[field_name]
        if not _names(value):
            raise AdapterValidationError(f"{CONFIG_FILE}: {field_name} must be a string or a list of strings, "
                                         f"got {value!r}")
        if field_name != "layers_pattern" and isinstance(value, str) and patterns is not None:
            patterns.compile(value, f"{CONFIG_FILE}: {field_name}")
        if field_name == "layers_pattern" and patterns is not None:
            for name in [value] if isinstance(value, str) else value or []:
                patterns.compile(name, f"{CONFIG_FILE}: layers_pattern")
    layers = config["layers_to_transform"]
    if layers is not None and not (isinstance(layers, int) and not isinstance(layers, bool)) and not (
            isinstance(layers, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in layers)):
        raise AdapterValidationError(f"{CONFIG_FILE}: layers_to_transform must be a layer index or a list of "
                                     f"them, got {layers!r}")
    if isinstance(config["target_modules"], str):
        for field_name in ("layers_to_transform", "layers_pattern"):
            if config[field_name] is not None:
                raise AdapterValidationError(f"{CONFIG_FILE}: {field_name} cannot be used when target_modules is a "
                                             "string (PEFT refuses this config)")
    if config["layers_pattern"] and config["layers_to_transform"] is None:
        raise AdapterValidationError(f"{CONFIG_FILE}: layers_pattern needs layers_to_transform (PEFT refuses this "
                                     "config)")


def _check_pattern_tables(config: dict, patterns: PatternMatcher | None) -> None:
    for field_name, valid, what in (("rank_pattern", _is_positive_int, "a positive integer"),
                                    ("alpha_pattern", _is_number, "a finite number")):
        table = config[field_name]
        if table is None:
            config[field_name] = table = {}  # PEFT's LoraConfig reads null as no pattern
        if not isinstance(table, dict):
            raise AdapterValidationError(f"{CONFIG_FILE}: {field_name} must be an object, got {table!r}")
        for key, value in table.items():
            if patterns is not None:
                patterns.compile(key, f"{CONFIG_FILE}: {field_name} key")
            if not valid(value):
                raise AdapterValidationError(f"{CONFIG_FILE}: {field_name}[{key!r}] must be {what}, got {value!r}")


def reject_unknown(config: dict) -> None:
    """Refuse a field no table of peft_fields.py names (a newer PEFT's, or a typo) set to anything
    but off (null, false, 0, empty): what it does to the adapter's output is unknown here, so it is
    never ignored silently. A newer PEFT writes its new fields at their defaults, mostly off."""
    known = PEFT_DEFAULTS.keys() | UNSUPPORTED.keys() | IGNORED
    unknown = sorted(name for name, value in config.items() if name not in known and value not in (None, False, 0, "")
                     and value != {} and value != [])
    if unknown:
        values = ", ".join(f"{name}={json.dumps(config[name])}" for name in unknown)
        raise AdapterValidationError(
            f"{CONFIG_FILE}: {values}: not a LoRA field this server knows (PEFT 0.21's are), so what it does to "
            "the adapter's output cannot be served as PEFT would; remove it if it is only metadata", unknown[0])


def reject_unsupported(config: dict) -> None:
    """Refuse a config that turns on a feature plain LoRA on a shared base cannot serve; the
    error's field is the first such config field, its message lists them all."""
    problems = [(name, f"{what} ({name}={json.dumps(config[name])})") for name, (_, what) in UNSUPPORTED.items()
                if name in config and is_set(name, config[name])]
    init = config["init_lora_weights"]
    if isinstance(init, str) and init.lower().startswith(BASE_CHANGING_INITS):
        problems.append(("init_lora_weights", f"init_lora_weights={init!r}, which changes the base model's weights "
                                              "when PEFT loads the adapter (convert it to a plain LoRA first)"))
    targets = config["target_modules"] or []
    targets = [targets] if isinstance(targets, str) else targets
    bad = [t for t in targets if any(k in t for k in ("embed", "lm_head"))]
    if bad:
        problems.append(("target_modules", f"embedding or lm_head targets {bad}"))
    if problems:
        raise AdapterValidationError("unsupported adapter features: " + "; ".join(p for _, p in problems),
                                     problems[0][0])
