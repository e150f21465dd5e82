"""Per-device state of the CUDA LoRA kernels: the NVRTC-compiled module and static scratch.

Compiled once per process and device through CuPy (``cupy.RawModule``, NVRTC, for the
device's own architecture: CuPy passes the device's ``-arch``; the sources with Hopper-only
paths for sm_90a, ``loraplex.kernels.cuda._nvrtc``); cached in an explicit
``RuntimeCache`` object. Scratch (fp32 split-K partials and the self-resetting
per-item counters) is allocated on first use and only grows (``GrowOnly``): growing is
refused while the current stream is capturing a CUDA graph, and an outgrown buffer is kept,
not freed, so a captured graph never points at memory that the allocator could hand to
another tensor (a long prefill after the decode graphs were captured grows the scratch).
"""

from __future__ import annotations

import contextlib
import functools
import os
import warnings
from dataclasses import dataclass, field

import torch

from loraplex.kernels.cuda._launch_ex import MIN_COMPUTE_CAPABILITY
from loraplex.kernels.cuda._nvrtc import CubinModule, arch_specific_target
from loraplex.kernels.cuda._scratch import GrowOnly

_CSRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc")
_DTYPE_TAG = {torch.bfloat16: "bf16", torch.float16: "fp16"}
LORA_SOURCES = ("lora_shrink_dec.cu", "lora_expand_dec.cu", "lora_shrink.cu", "lora_expand.cu")
_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_PREFERRED_CARVEOUT = 9  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT


def _read_source(name: str, seen: set[str] | None = None) -> str:
    """The source with its local "*.cuh" includes pasted in, recursively and once each (so
    CuPy's cache key covers the headers and NVRTC needs no include path)."""
    seen = set() if seen is None else seen
    with open(os.path.join(_CSRC, name), encoding="utf-8") as f:
        lines = f.read().splitlines()
    out = []
    for line in lines:
        if line.startswith('#include "') and line.endswith('.cuh"'):
            header = line[len('#include "') : -1]
            if header not in seen:
                seen.add(header)
                out.append(_read_source(header, seen))
        elif line.strip() != "#pragma once":
            out.append(line)
    return "\n".join(out) + "\n"


@dataclass(slots=True)
class DeviceRuntime:
    """Compiled kernels, scratch and wrapped streams of one CUDA device."""

    device: torch.device
    modules: dict = field(default_factory=dict)
    streams: dict = field(default_factory=dict)
    resident: dict = field(default_factory=dict)  # (kind, dtype, variant, threads) -> blocks at once
    carveouts: dict = field(default_factory=dict)  # kernel name -> the carveout set on it
    smem_limits: dict = field(default_factory=dict)  # kernel name -> its dynamic shared memory limit set
    partials: GrowOnly = field(init=False)  # fp32 split-K partials
    counters: GrowOnly = field(init=False)  # int32 per-item counters, zero between launches
    pdl: bool = field(init=False)  # programmatic dependent launch available (kernels/cuda/_launch_ex.py)
    clusters: bool = field(init=False)  # thread-block clusters available (sm_90+)
    tma: bool = field(init=False)  # TMA tensor copies available (sm_90+): the prefill shrink's x
    tensor_maps: dict = field(default_factory=dict)  # (x pointer, shape, stride, dtype) -> TensorMap
    sms: int = field(init=False)  # multiprocessors of the device

    def __post_init__(self) -> None:
        self.partials = GrowOnly(torch.float32, self.device, 1 << 16)  # nothing allocated until used
        self.counters = GrowOnly(torch.int32, self.device, 1 << 12)
        self.pdl = torch.cuda.get_device_capability(self.device) >= MIN_COMPUTE_CAPABILITY
        self.clusters = self.pdl
        self.tma = self.pdl
        self.sms = torch.cuda.get_device_properties(self.device).multi_processor_count

    def module(self, source: str):
        """The module of ``csrc/{source}``, compiled on first use (sm_90a where the source has
        Hopper-only paths and the device is a Hopper: ``_nvrtc``)."""
        import cupy  # noqa: PLC0415

        if source not in self.modules:
            target = arch_specific_target(source, torch.cuda.get_device_capability(self.device))
            with cupy.cuda.Device(self.device.index):
                if target is not None:  # (sm_90a: the prefill kernels' wgmma)
                    # -default-device: functions without an execution space (the expand's generic
                    # lambda) are device functions, as RawModule's compile takes them
                    module = CubinModule(_read_source(source), source, target, ("-std=c++17", "-default-device"))
                else:
                    module = cupy.RawModule(code=_read_source(source), options=("-std=c++17",))
                    module.compile()
            self.modules[source] = module
        return self.modules[source]

    def compile_all(self) -> None:
        """Compile every LoRA kernel module now (the prefill ones take seconds: a step that met
        them first would hold every stream that long)."""
        for source in LORA_SOURCES:
            self.module(source)

    def function(self, kind: str, dtype: torch.dtype, variant: str, carveout: int | None = None,
                 smem: int = 0):
        """The extern "C" kernel ``lora_{kind}_{dtype}_{variant}`` of ``csrc/lora_{kind}.cu``;
        carveout: the share of shared memory (percent) its multiprocessors prefer over L1; smem:
        the dynamic shared memory its launches give a block (its limit raised to that)."""
        import cupy  # noqa: PLC0415

        name = f"lora_{kind}_{_DTYPE_TAG[dtype]}_{variant}"
        function = self.module(f"lora_{kind}.cu").get_function(name)
        if carveout is not None and self.carveouts.get(name) != carveout:
            with cupy.cuda.Device(self.device.index):
                cupy.cuda.driver.funcSetAttribute(function.kernel.ptr, _PREFERRED_CARVEOUT, carveout)
            self.carveouts[name] = carveout
        if smem > self.smem_limits.get(name, 0):  # (the default limit is 48 KB less the static shared memory)
            with cupy.cuda.Device(self.device.index):
                cupy.cuda.driver.funcSetAttribute(function.kernel.ptr, _MAX_DYNAMIC_SHARED, smem)
            self.smem_limits[name] = smem
        return function

    def resident_blocks(self, kind: str, dtype: torch.dtype, variant: str, threads: int, smem: int = 0,
                        carveout: int | None = None) -> int:
        """How many blocks of ``threads`` threads (and ``smem`` bytes of dynamic shared memory) of
        that kernel the device runs at once (the driver's occupancy for its registers and shared
        memory, times the multiprocessors), with the carveout its launches set."""
        import cupy  # noqa: PLC0415

        key = (kind, dtype, variant, threads, smem, carveout)
        if key not in self.resident:
            function = self.function(kind, dtype, variant, carveout=carveout, smem=smem)
            with cupy.cuda.Device(self.device.index):
                per_sm = cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(function.kernel.ptr, threads,
                                                                                     smem)
            self.resident[key] = max(1, per_sm) * self.sms
        return self.resident[key]

    def template_function(self, source: str, expression: str):
        """The instantiation ``expression`` (e.g. "paged_decode<0, 128, 1>") of a template kernel
        of ``csrc/{source}``, compiled on first use (one NVRTC module per instantiation)."""
        import cupy  # noqa: PLC0415

        key = (source, expression)
        if key not in self.modules:
            with cupy.cuda.Device(self.device.index):
                module = cupy.RawModule(
                    code=_read_source(source), options=("-std=c++17",), name_expressions=(expression,)
                )
                module.compile()
            self.modules[key] = module
        return self.modules[key].get_function(expression)

    def scratch(self, n_partials: int, n_counters: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 partials of >= n_partials elements and zeroed int32 counters (>= n_counters)."""
        if not (self.partials.fits(n_partials) and self.counters.fits(n_counters)) \
                and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                "LoRA kernel scratch must grow (a larger batch than any call before the capture); "
                "call add_lora_slices once with the largest shape before capturing a CUDA graph"
            )
        return self.partials.at_least(n_partials), self.counters.at_least(n_counters)

    @contextlib.contextmanager
    def launching(self):
        """Context for launches: this device current in CuPy, PyTorch's current stream."""
        import cupy  # noqa: PLC0415

        with cupy.cuda.Device(self.device.index), self.stream():
            yield

    def stream(self):
        """PyTorch's current stream on this device, wrapped for CuPy launches."""
        import cupy  # noqa: PLC0415

        ts = torch.cuda.current_stream(self.device)
        key = ts.cuda_stream
        wrapped = self.streams.get(key)
        if wrapped is None:
            try:
                wrapped = cupy.cuda.Stream.from_external(ts)
            except (AttributeError, TypeError, ValueError):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)
                    wrapped = cupy.cuda.ExternalStream(key, self.device.index)
            self.streams[key] = wrapped
        return wrapped


@dataclass(slots=True)
class RuntimeCache:
    """One DeviceRuntime per CUDA device index, created on first use."""

    runtimes: dict = field(default_factory=dict)

    def get(self, device: torch.device) -> DeviceRuntime:
        index = device.index if device.index is not None else torch.cuda.current_device()
        rt = self.runtimes.get(index)
        if rt is None:
            rt = DeviceRuntime(torch.device("cuda", index))
            self.runtimes[index] = rt
        return rt


@functools.cache
def default_cache() -> RuntimeCache:
    """The process's RuntimeCache (created lazily, on the first CUDA call)."""
    return RuntimeCache()
