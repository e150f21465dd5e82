"""kernels/cuda/_launch_ex.py without a GPU: its ctypes mirrors of cuda.h's launch structures have
the C compiler's layout (where gcc and cuda.h are present), and kernel arguments are passed
as the C types the kernels declare."""

from __future__ import annotations

import ctypes
import glob
import os
import shutil
import subprocess

import numpy as np
import pytest

from kernels.cuda import _launch_ex


def _cuda_include() -> str | None:
    roots = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"))]
    return next((f"{r}/include" for r in roots if r and os.path.exists(f"{r}/include/cuda.h")), None)


C_LAYOUT = r"""
#include <cuda.h>
#include <stddef.h>
#include <stdio.h>
int main(void) {
  printf("%zu %zu %zu %zu %zu %zu %d %d\n", sizeof(CUlaunchAttribute), offsetof(CUlaunchAttribute, value),
         sizeof(CUlaunchConfig), offsetof(CUlaunchConfig, hStream), offsetof(CUlaunchConfig, attrs),
         offsetof(CUlaunchConfig, numAttrs), (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
         (int)CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION);
  return 0;
}
"""


def c_probe(source: str, tmp_path) -> list[int]:
    """The integers a C program printed, built with gcc against cuda.h."""
    src, exe = tmp_path / "probe.c", tmp_path / "probe"
    src.write_text(source)
    subprocess.run(["gcc", f"-I{_cuda_include()}", str(src), "-o", str(exe)], check=True, timeout=120)
    return [int(v) for v in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()]


@pytest.mark.skipif(shutil.which("gcc") is None or _cuda_include() is None, reason="needs gcc and cuda.h")
def test_launch_structures_have_cuda_h_layout(tmp_path) -> None:
    c = c_probe(C_LAYOUT, tmp_path)
    ours = [ctypes.sizeof(_launch_ex.LaunchAttribute), _launch_ex.LaunchAttribute.value.offset, ctypes.sizeof(_launch_ex.LaunchConfig),
            _launch_ex.LaunchConfig.hStream.offset, _launch_ex.LaunchConfig.attrs.offset, _launch_ex.LaunchConfig.numAttrs.offset,
            _launch_ex.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, _launch_ex.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION]
    assert ours == c


def test_kernel_params_point_at_values_of_the_declared_c_types() -> None:
    args = (np.uint64(2**63 + 5), np.int32(-3), np.int64(-(1 << 40)), np.float32(0.5))
    array, keep = _launch_ex.kernel_params(args)
    types = (ctypes.c_uint64, ctypes.c_int32, ctypes.c_int64, ctypes.c_float)
    got = [ctypes.cast(array[i], ctypes.POINTER(t)).contents.value for i, t in enumerate(types)]
    assert got == [2**63 + 5, -3, -(1 << 40), 0.5] and len(keep) == 4


def test_kernel_params_refuse_untyped_arguments() -> None:
    with pytest.raises(TypeError, match="kernel argument 7"):
        _launch_ex.kernel_params((np.int32(1), 7))
