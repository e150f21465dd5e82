"""What an adapter config's patterns decide for each adapted module: its rank and alpha
(rank_pattern, alpha_pattern) and whether target_modules names it.

They are judged once, at upload, by ``PatternJudge`` (regex matching under patterns.py's CPU
budget); the outcome is kept with the stored adapter as ``PatternValue``s, and every later read of
it answers from them through ``StoredDecisions``, which matches nothing. A read that has no stored
outcome (a folder put in the adapter directory by hand, a record written before it was kept) is
judged as an upload is.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from adapter_store.errors import AdapterValidationError
from adapter_store.format.patterns import PatternMatcher

CONFIG_FILE = "adapter_config.json"
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")


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
    """The module's name in a Llama model, as PEFT matches target_modules and patterns against it."""
    return f"model.layers.{layer}.{'self_attn' if module in ATTENTION else 'mlp'}.{module}"


def targeted_by_list(targets: list[str], layer: int, module: str) -> bool:
    """PEFT's rule for a list: the module's name is an entry or ends with '.' + an entry."""
    key = module_key(layer, module)
    return any(key == t or key.endswith(f".{t}") for t in targets)


def refuse_untargeted(targets: object, layer: int, module: str) -> None:
    raise AdapterValidationError(f"layers.{layer}.{module}: has weights but is not among target_modules "
                                 f"{targets!r} (PEFT would ignore them)")


class PatternJudge:
    """Decides by matching the config's patterns (at upload); ``decided`` is what to keep."""

    def __init__(self, config: dict, default_rank: int, default_alpha: float, matcher: PatternMatcher) -> None:
        self._config = config
        self._defaults = (default_rank, default_alpha)
        self._matcher = matcher
        self.decided: list[PatternValue] = []

    def check_targeted(self, layer: int, module: str) -> None:
        """A weight for a module that target_modules leaves out would be ignored by PEFT (an
        unexpected key) but applied here: refuse it. A string is a full-match pattern (or
        "all-linear")."""
        targets = self._config.get("target_modules")
        if not targets or targets == "all-linear":
            return
        if isinstance(targets, str):
            field = f"{CONFIG_FILE}: target_modules"
            if not self._matcher.fullmatch(targets, module_key(layer, module), field):
                refuse_untargeted(targets, layer, module)
        elif not targeted_by_list(targets, layer, module):
            refuse_untargeted(targets, layer, module)

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

    def __init__(self, config: dict, default_rank: int, default_alpha: float,
                 stored: Iterable[PatternValue]) -> None:
        self._config = config
        self._defaults = (default_rank, default_alpha)
        self._values = {(v.layer, v.module): v for v in stored}
        self.decided = list(self._values.values())

    def check_targeted(self, layer: int, module: str) -> None:
        """A list is checked again (plain comparisons); a pattern let every module with weights
        through at upload, or the adapter would not have been stored."""
        targets = self._config.get("target_modules")
        if isinstance(targets, list) and targets and not targeted_by_list(targets, layer, module):
            refuse_untargeted(targets, layer, module)

    def values(self, layer: int, module: str) -> tuple[int, float]:
        value = self._values.get((layer, module))
        return self._defaults if value is None else (value.rank, value.alpha)
