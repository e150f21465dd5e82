"""Modules compiled for an architecture-specific target, through NVRTC directly.

CuPy's ``RawModule`` compiles for the device's own ``-arch=sm_XY``, and appends that option
to whatever it is given, so it cannot target ``sm_90a``: the Hopper-only instructions (wgmma,
the prefill shrink's and expand's warpgroup products: csrc/lora_wgmma.cuh) exist there alone. Sources that
use them are compiled here instead, by CuPy's NVRTC binding, to a cubin for ``sm_90a`` and
loaded as a CUDA module; everything else stays on ``RawModule``. The sources guard those
instructions with ``__CUDA_ARCH_FEAT_SM90_ALL``, so the same file still compiles (without them)
for every other target.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

ARCH_SPECIFIC_SOURCES = frozenset({"lora_shrink.cu", "lora_expand.cu"})  # sources with sm_90a-only code paths
_ARCH_SPECIFIC_TARGETS = {(9, 0): "sm_90a"}  # compute capability -> the target that has them


def arch_specific_target(source: str, capability: tuple[int, int]) -> str | None:
    """The architecture-specific target to compile `source` for on a device of `capability`,
    or None where CuPy's own compile (the plain target) is the one."""
    if source not in ARCH_SPECIFIC_SOURCES:
        return None
    return _ARCH_SPECIFIC_TARGETS.get(tuple(capability))


@dataclass(frozen=True, slots=True)
class LoadedKernel:
    """One kernel of a module loaded from a cubin: ``kernel`` is the CUDA function (``.ptr``),
    as a ``cupy.RawKernel``'s ``kernel`` is; what `launch_ex` and the attribute and occupancy
    calls read (the prefill shrink and expand are launched only through `launch_ex`)."""

    kernel: object


def cached_cubin(cache_dir: str | None, key: tuple[str, ...], compile_cubin: Callable[[], bytes]) -> bytes:
    """The cubin ``compile_cubin`` makes for ``key`` (everything the bytes depend on: code,
    target, options, compiler version), kept in ``cache_dir`` under the key's digest, as CuPy
    keeps its own modules, so a restarted server loads what an earlier one compiled (the
    prefill modules take seconds). None: no cache. Written whole or not at all (a temporary
    file renamed); a cache that cannot be written is logged and the compile's bytes used."""
    if cache_dir is None:
        return compile_cubin()
    digest = hashlib.sha256("\0".join(key).encode()).hexdigest()
    path = os.path.join(cache_dir, f"{digest}.cubin")
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:  # not there (or unreadable): compiled, and written if it can be
        pass
    cubin = compile_cubin()
    temporary = None
    try:
        os.makedirs(cache_dir, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=cache_dir, suffix=".tmp", delete=False) as f:
            temporary = f.name
            f.write(cubin)
        os.replace(temporary, path)
    except OSError as e:
        log.warning("kernel cache %s not written (%s): the next process compiles again", cache_dir, e)
        if temporary is not None:
            with contextlib.suppress(OSError):
                os.remove(temporary)
    return cubin


def cubin_cache_dir() -> str:
    """Where the cubins are kept: in CuPy's own kernel cache, by CuPy's rule (``CUPY_CACHE_DIR``,
    else ~/.cupy/kernel_cache)."""
    return os.path.join(os.environ.get("CUPY_CACHE_DIR", os.path.expanduser("~/.cupy/kernel_cache")),
                        "loraplex-cubin")


class CubinModule:
    """``code`` compiled by NVRTC for ``target`` (e.g. "sm_90a") and loaded on the current device;
    the cubin kept on disk (``cached_cubin``, ``cubin_cache_dir``)."""

    def __init__(self, code: str, name: str, target: str, options: tuple[str, ...]) -> None:
        import cupy  # noqa: PLC0415
        from cupy_backends.cuda.libs import nvrtc  # noqa: PLC0415

        def compile_cubin() -> bytes:
            prog = nvrtc.createProgram(code, name, (), ())
            try:
                try:
                    nvrtc.compileProgram(prog, (*options, f"-arch={target}"))
                except nvrtc.NVRTCError as e:
                    raise RuntimeError(
                        f"NVRTC could not compile {name} for {target}:\n{nvrtc.getProgramLog(prog)}") from e
                return bytes(nvrtc.getCUBIN(prog))
            finally:
                nvrtc.destroyProgram(prog)

        version = ".".join(map(str, nvrtc.getVersion()))
        cubin = cached_cubin(cubin_cache_dir(), (code, name, target, *options, f"nvrtc {version}"), compile_cubin)
        self._module = cupy.cuda.function.Module()
        self._module.load(cubin)
        self._kernels: dict[str, LoadedKernel] = {}

    def get_function(self, name: str) -> LoadedKernel:
        if name not in self._kernels:
            self._kernels[name] = LoadedKernel(self._module.get_function(name))
        return self._kernels[name]
