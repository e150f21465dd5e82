"""PEFT LoRA adapter format: parse and validate an adapter folder, without torch.

An adapter is PEFT's ``adapter_config.json`` + ``adapter_model.safetensors``. The config is
read as PEFT reads it, defaults included (peft_config.py); the patterns in it decide each
module's rank and alpha (pattern_decisions.py). Validation names what is wrong: unsupported
features (DoRA, modules_to_save, embedding or lm_head targets, bias training), pickle files,
tensors whose shapes do not fit the declared rank or the base model, weights for modules PEFT
would not adapt. The same function guards uploads (store, server) and loads (engine).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from loraplex.adapter_store.errors import AdapterValidationError
from loraplex.adapter_store.format.architectures import ALL_TARGETS
from loraplex.adapter_store.format.base_shapes import BaseShapes
from loraplex.adapter_store.format.pattern_decisions import PatternJudge, PatternValue, StoredDecisions
from loraplex.adapter_store.format.patterns import PatternMatcher
from loraplex.adapter_store.format.peft_config import CONFIG_FILE, read_config
from loraplex.adapter_store.format.safetensors_header import TensorInfo, non_finite_tensors, read_header

WEIGHTS_FILE = "adapter_model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
SUPPORTED_DTYPES = ("F32", "F16", "BF16")
FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32 (a module's scale must be one)
# target_modules left out, no base known: PEFT's default of every family that has one
NO_BASE_DEFAULT_TARGETS = ("q_proj", "v_proj")
_TENSOR = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(\w+)\.(\w+)\.lora_(A|B)(?:\.default)?\.weight$")


@dataclass(frozen=True, slots=True)
class LoraModuleSpec:
    """One adapted projection in one layer: A [rank, in] and B [out, rank] as PEFT stores them."""

    layer: int
    module: str  # a LoRA target of the base's family, as PEFT names it (architectures.py)
    rank: int
    scale: float  # alpha / r, or alpha / sqrt(r) with rsLoRA
    a_name: str
    b_name: str
    in_features: int
    out_features: int


@dataclass(frozen=True, slots=True)
class AdapterSpec:
    """A validated adapter: its hyper-parameters and the modules it adapts."""

    rank: int
    lora_alpha: float
    use_rslora: bool
    dtype: str  # safetensors dtype: F32, F16 or BF16
    modules: tuple[LoraModuleSpec, ...]
    num_bytes: int
    base_model_name: str | None
    # the weights file's parsed header (name -> dtype, shape, data offsets), so the loader's
    # plan does not parse it again
    tensors: Mapping[str, TensorInfo] = field(default_factory=dict, repr=False, compare=False)
    # the base model the shapes were checked against (None: none), so a later check against
    # the same base can reuse this spec
    checked_base: BaseShapes | None = field(default=None, repr=False, compare=False)
    # what rank_pattern / alpha_pattern decided, module by module (only where a key matched):
    # kept with the stored adapter so that reading it again matches no pattern
    pattern_values: tuple[PatternValue, ...] = ()

    @property
    def target_modules(self) -> tuple[str, ...]:
        """The modules it adapts, in the order of the base's table (of every family's, unchecked)."""
        order = self.checked_base.architecture.target_modules if self.checked_base is not None else ALL_TARGETS
        return tuple(p for p in order if any(m.module == p for m in self.modules))

    @property
    def max_rank(self) -> int:
        return max(m.rank for m in self.modules)


def parse_adapter_files(
    files: Mapping[str, bytes], base: BaseShapes | None = None, max_rank: int = 128,
    decided: tuple[PatternValue, ...] | None = None,
) -> AdapterSpec:
    """Validate a PEFT LoRA folder given as {filename: bytes}; return its spec.

    ``decided``: the spec's ``pattern_values`` from when these files were stored (their
    patterns are then not matched again); None judges the patterns now, as an upload does.
    Raises AdapterValidationError naming the file, tensor or feature at fault.
    """
    check_file_names(files)
    config, tensors, decider, modules = _judge(files[CONFIG_FILE], lambda: read_header(files[WEIGHTS_FILE]), base,
                                               max_rank, decided)
    return AdapterSpec(
        rank=int(config["r"]),
        lora_alpha=float(config["lora_alpha"]),
        use_rslora=bool(config["use_rslora"]),
        dtype=next(iter(tensors.values())).dtype,
        modules=modules,
        num_bytes=len(files[WEIGHTS_FILE]),
        base_model_name=config.get("base_model_name_or_path"),
        tensors=MappingProxyType(tensors),
        checked_base=base,
        pattern_values=tuple(decider.decided),
    )


def check_file_names(names: Iterable[str]) -> None:
    """AdapterValidationError for pickle files, or without the config and the safetensors weights."""
    names = set(names)
    pickles = sorted(f for f in names if f.endswith(PICKLE_SUFFIXES))
    if pickles:
        raise AdapterValidationError(
            f"pickle files are refused ({', '.join(pickles)}): save the adapter with "
            "safe_serialization=True (adapter_model.safetensors)"
        )
    for required in (CONFIG_FILE, WEIGHTS_FILE):
        if required not in names:
            raise AdapterValidationError(f"missing {required}")


def check_upload_head(config: bytes, weights_head: bytes, weights_size: int, base: BaseShapes | None,
                      max_rank: int) -> None:
    """The checks of ``parse_adapter_files`` that need no tensor data, for an upload still on its way:
    its config whole and its weights' first bytes (``weights_head``: at least 8 + the header of the
    ``weights_size``-byte file). Raises the same AdapterValidationError the whole upload's parse would."""
    _judge(config, lambda: read_header(weights_head, WEIGHTS_FILE, weights_size), base, max_rank, None)


def _judge(config_raw: bytes, read_tensors: Callable[[], dict[str, TensorInfo]], base: BaseShapes | None,
           max_rank: int, decided: tuple[PatternValue, ...] | None
           ) -> tuple[dict, dict[str, TensorInfo], PatternJudge | StoredDecisions, tuple[LoraModuleSpec, ...]]:
    """The config read (patterns judged now, or as ``decided``), then the weights' header, and every
    module checked."""
    patterns = PatternMatcher() if decided is None else None
    config = read_config(config_raw, patterns)
    tensors = read_tensors()
    defaults = base.architecture.peft_defaults if base is not None else NO_BASE_DEFAULT_TARGETS
    decider = (PatternJudge(config, patterns, defaults) if patterns is not None
               else StoredDecisions(config, decided, defaults))
    return config, tensors, decider, _module_specs(config, tensors, base, max_rank, decider)


def parse_adapter_upload(
    files: Mapping[str, bytes], base: BaseShapes | None = None, max_rank: int = 128
) -> AdapterSpec:
    """``parse_adapter_files`` for an adapter about to be stored: its weights are also read, and
    one with an infinity or a NaN is refused (it would only ever generate garbage)."""
    spec = parse_adapter_files(files, base, max_rank)
    bad = non_finite_tensors(files[WEIGHTS_FILE], spec.tensors)
    if bad:
        more = f" and {len(bad) - 1} more" if len(bad) > 1 else ""
        raise AdapterValidationError(f"{WEIGHTS_FILE}: tensor {bad[0]!r}{more} holds infinite or NaN values")
    return spec


def _module_specs(
    config: dict, tensors: dict[str, TensorInfo], base: BaseShapes | None, max_rank: int,
    decider: PatternJudge | StoredDecisions,
) -> tuple[LoraModuleSpec, ...]:
    targets = {t.module: t.parent for t in base.architecture.targets} if base is not None else ALL_TARGETS
    pairs: dict[tuple[int, str], dict[str, str]] = {}
    for name, info in tensors.items():
        m = _TENSOR.match(name)
        if m is None or targets.get(m.group(3)) != m.group(2):
            family = f"a {base.architecture.family} model's" if base is not None else "the"
            raise AdapterValidationError(
                f"tensor {name!r} is not a LoRA A/B weight of {family} linear projections ({', '.join(targets)}; "
                "embedding, lm_head, bias, DoRA magnitude and other tensors are not supported)"
            )
        if info.dtype not in SUPPORTED_DTYPES:
            raise AdapterValidationError(f"tensor {name!r}: dtype {info.dtype} not supported ({SUPPORTED_DTYPES})")
        if len(info.shape) != 2:
            raise AdapterValidationError(f"tensor {name!r}: expected 2 dimensions, got shape {list(info.shape)}")
        pairs.setdefault((int(m.group(1)), m.group(3)), {})[m.group(4)] = name
    if not pairs:
        raise AdapterValidationError(f"{WEIGHTS_FILE} holds no LoRA tensors")
    if len({t.dtype for t in tensors.values()}) > 1:
        raise AdapterValidationError(f"{WEIGHTS_FILE}: tensors have mixed dtypes")
    layers = config.get("layers_to_transform")
    layers = {layers} if isinstance(layers, int) else (set(layers) if layers else None)
    for layer, module in pairs:
        decider.check_targeted(layer, module)
    specs = [
        _one_module(layer, module, names, tensors, config, base, max_rank, layers, decider)
        for (layer, module), names in sorted(pairs.items())
    ]
    return tuple(specs)


def _one_module(
    layer: int,
    module: str,
    names: dict[str, str],
    tensors: dict[str, TensorInfo],
    config: dict,
    base: BaseShapes | None,
    max_rank: int,
    layers: set[int] | None,
    decider: PatternJudge | StoredDecisions,
) -> LoraModuleSpec:
    where = f"layers.{layer}.{module}"
    if set(names) != {"A", "B"}:
        missing = "lora_B" if "A" in names else "lora_A"
        raise AdapterValidationError(f"{where}: {missing} weight is missing")
    if layers is not None and layer not in layers:
        raise AdapterValidationError(f"{where}: layer {layer} is not in layers_to_transform {sorted(layers)}")
    a, b = tensors[names["A"]].shape, tensors[names["B"]].shape
    rank, alpha = decider.values(layer, module)
    rank, alpha = int(rank), float(alpha)
    if rank < 1 or rank > max_rank:
        raise AdapterValidationError(f"{where}: rank {rank} outside the supported range 1..{max_rank}")
    if a[0] != rank or b[1] != rank:
        raise AdapterValidationError(
            f"tensor {names['A']!r} has shape {list(a)} and {names['B']!r} {list(b)}, "
            f"which does not match the declared rank {rank}"
        )
    if base is not None:
        _check_base_fit(where, layer, module, a, b, names, base)
    scale = alpha / math.sqrt(rank) if config["use_rslora"] else alpha / rank
    if not abs(scale) <= FLOAT32_MAX:  # the kernels' scale tables are float32: inf, then NaN in every output
        raise AdapterValidationError(f"{where}: lora_alpha {alpha:g} gives a scale of {scale:g}, past float32's "
                                     f"{FLOAT32_MAX:.4g}: every output would be infinite or NaN", "lora_alpha")
    return LoraModuleSpec(layer, module, rank, scale, names["A"], names["B"], a[1], b[0])


def _check_base_fit(
    where: str, layer: int, module: str, a: tuple, b: tuple, names: dict[str, str], base: BaseShapes
) -> None:
    if layer >= base.num_layers:
        raise AdapterValidationError(f"{where}: the base model has only {base.num_layers} layers")
    fan_in, fan_out = base.projection_shapes()[module]
    if a[1] != fan_in:
        raise AdapterValidationError(
            f"tensor {names['A']!r} has shape {list(a)}: the base model's {module} takes {fan_in} inputs"
        )
    if b[0] != fan_out:
        raise AdapterValidationError(
            f"tensor {names['B']!r} has shape {list(b)}: the base model's {module} gives {fan_out} outputs"
        )
