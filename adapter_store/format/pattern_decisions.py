"""What an adapter config's patterns decide for each adapted module: its rank and alpha
(rank_pattern, alpha_pattern) and whether PEFT adapts it at all (target_modules,
exclude_modules, layers_pattern).

They are judged once, at upload, by ``PatternJudge`` (regex matching under patterns.py's CPU
budget); the outcome is kept with the stored adapter as ``PatternValue``s, and every later read of
it answers from them through ``StoredDecisions``, which matches nothing. A read that has no stored
outcome (a folder put in the adapter directory by hand, a record written before it was kept) is
judged as an upload is.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from loraplex.adapter_store.errors import AdapterValidationError
from loraplex.adapter_store.format.architectures import ALL_TARGETS
from loraplex.adapter_store.format.patterns import PatternMatcher
from loraplex.adapter_store.format.peft_config import CONFIG_FILE


@dataclass(frozen=True, slots=True)
class PatternValue:
    """The rank and alpha of one module where a rank_pattern or alpha_pattern key matched it."""

    layer: int
    module: str
    rank: int
    alpha: float

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or isinstance(self.rank, bool) or self.rank < 1:
            raise ValueError(f"pattern value of layers.{self.layer}.{self.module}: rank must be a positive integer")

    @classmethod
    def from_dict(cls, item: Mapping[str, object]) -> PatternValue:
        """From ``dataclasses.asdict``'s form (a stored record's JSON)."""
        return cls(int(item["layer"]), str(item["module"]), item["rank"], float(item["alpha"]))


def module_key(layer: int, module: str) -> str:
    """The module's name in the base model, as PEFT matches target_modules and patterns against it
    (every family serves a target name under the same parent: architectures.ALL_TARGETS)."""
    return f"model.layers.{layer}.{ALL_TARGETS[module]}.{module}"


def targets_of(config: dict, defaults: tuple[str, ...] | None) -> str | list[str]:
    """target_modules as PEFT applies it: left out (or null), the family's default (``defaults``,
    architectures.Architecture.peft_defaults; None: PEFT has none and refuses the config)."""
    targets = config.get("target_modules")
    if targets is not None:
        return targets
    if defaults is None:
        raise AdapterValidationError(f"left out of {CONFIG_FILE}, and PEFT has no default target modules for this "
                                     "base model's family: name them", "target_modules")
    return list(defaults)


def in_list(names: list[str], key: str) -> bool:
    """PEFT's rule for a list of module names: the key is an entry or ends with '.' + an entry."""
    return any(key == t or key.endswith(f".{t}") for t in names)


def by_layer_index(config: dict) -> bool:
    """layers_to_transform selects layers (PEFT: an index, or a list that is not empty)."""
    layers = config.get("layers_to_transform")
    return layers is not None and layers != []


def refuse(layer: int, module: str, why: str) -> None:
    raise AdapterValidationError(f"layers.{layer}.{module}: has weights but {why} (PEFT would ignore them)")


class PatternJudge:
    """Decides by matching the config's patterns (at upload); ``decided`` is what to keep."""

    def __init__(self, config: dict, matcher: PatternMatcher, default_targets: tuple[str, ...] | None) -> None:
        self._config = config
        self._defaults = (config["r"], config["lora_alpha"])
        self._targets = targets_of(config, default_targets)
        self._matcher = matcher
        self.decided: list[PatternValue] = []

    def check_targeted(self, layer: int, module: str) -> None:
        """A weight for a module that PEFT does not adapt would be ignored by PEFT (an unexpected
        key) but applied here: refuse it. PEFT's rules: exclude_modules first, then target_modules
        (a string is a full-match pattern or "all-linear"; a list is matched by ``in_list``,
        within the layers that layers_to_transform and layers_pattern pick)."""
        key, targets = module_key(layer, module), self._targets
        if self._excluded(key):
            refuse(layer, module, f"exclude_modules {self._config['exclude_modules']!r} leaves it out")
        if isinstance(targets, str):
            if targets.lower() != "all-linear" and not self._matcher.fullmatch(
                    targets, key, f"{CONFIG_FILE}: target_modules"):
                refuse(layer, module, f"is not among target_modules {targets!r}")
            return
        if not in_list(targets, key):
            refuse(layer, module, f"is not among target_modules {targets!r}")
        if by_layer_index(self._config) and not self._layer_found(key):
            refuse(layer, module, f"layers_pattern {self._config['layers_pattern']!r} finds no layer index in "
                                  f"{key!r}")

    def _excluded(self, key: str) -> bool:
        exclude = self._config.get("exclude_modules")
        if isinstance(exclude, str):
            return self._matcher.fullmatch(exclude, key, f"{CONFIG_FILE}: exclude_modules")
        return isinstance(exclude, list) and in_list(exclude, key)

    def _layer_found(self, key: str) -> bool:
        """PEFT reads the layer index after one of layers_pattern's names (any, when there is none);
        a module name here has one index, the layer's, which _one_module checks."""
        names = self._config.get("layers_pattern") or []
        names = [names] if isinstance(names, str) else names
        field = f"{CONFIG_FILE}: layers_pattern"
        return not names or any(self._matcher.match(rf"(?:^|.*?\.){n}\.\d+\.", key, field, shown=n) for n in names)

    def values(self, layer: int, module: str) -> tuple[int, float]:
        """(rank, alpha) of the module: the first matching pattern key's, else the config's."""
        key = module_key(layer, module)
        rank = self._first_match("rank_pattern", key)
        alpha = self._first_match("alpha_pattern", key)
        if rank is None and alpha is None:
            return self._defaults
        value = PatternValue(layer, module, int(self._defaults[0] if rank is None else rank),
                             float(self._defaults[1] if alpha is None else alpha))
        self.decided.append(value)
        return value.rank, value.alpha

    def _first_match(self, field_name: str, key: str) -> float | None:
        """PEFT's rule: a pattern key matches a module name that ends with it (after a dot)."""
        table: Mapping[str, float] = self._config.get(field_name) or {}
        for pattern, value in table.items():
            if self._matcher.match(rf"(.*\.)?({pattern})$", key, f"{CONFIG_FILE}: {field_name} key", shown=pattern):
                return value
        return None


class StoredDecisions:
    """The same answers from the values kept at upload: no pattern is compiled or matched."""

    def __init__(self, config: dict, stored: Iterable[PatternValue], default_targets: tuple[str, ...] | None) -> None:
        self._config = config
        self._defaults = (config["r"], config["lora_alpha"])
        self._targets = targets_of(config, default_targets)
        self._values = {(v.layer, v.module): v for v in stored}
        self.decided = list(self._values.values())

    def check_targeted(self, layer: int, module: str) -> None:
        """Lists are checked again (plain comparisons); the patterns let every module with weights
        through at upload, or the adapter would not have been stored."""
        key, targets = module_key(layer, module), self._targets
        exclude = self._config.get("exclude_modules")
        if isinstance(exclude, list) and in_list(exclude, key):
            refuse(layer, module, f"exclude_modules {exclude!r} leaves it out")
        if isinstance(targets, list) and not in_list(targets, key):
            refuse(layer, module, f"is not among target_modules {targets!r}")

    def values(self, layer: int, module: str) -> tuple[int, float]:
        value = self._values.get((layer, module))
        return self._defaults if value is None else (value.rank, value.alpha)
