"""kernels/cuda/_launch_ex.py without a GPU: its ctypes mirrors of cuda.h's launch structures have
the C compiler's layout (where gcc and cuda.h are present), and kernel arguments are passed
as the C types the kernels declare."""

from __future__ import annotations

import ctypes
import shutil

import numpy as np
import pytest

from loraplex.kernels.cuda import _launch_ex
from c_probe import _cuda_include, c_probe


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


def test_every_argument_of_a_long_list_reads_back_as_its_c_type() -> None:
    """The launch paths pass ~30 arguments of mixed types, a by-value map among them: each pointer
    leads to its own value (one packed buffer, no slot overlapping the next)."""
    from loraplex.kernels.cuda._tensor_map import TensorMap

    m = TensorMap()
    ctypes.memmove(m.address, bytes(range(128)), 128)
    kinds = [(np.int32, ctypes.c_int32), (np.int64, ctypes.c_int64), (np.uint64, ctypes.c_uint64),
             (np.float32, ctypes.c_float)]
    args, expect = [], []
    for i in range(31):
        np_type, c_type = kinds[i % 4]
        value = np_type(-(i + 1) * 3 if np_type in (np.int32, np.int64) else (i + 1) * 7 if np_type is np.uint64
                        else 0.25 * i - 2)
        args.append(value)
        expect.append((c_type, value.item()))
        if i == 13:
            args.append(m)
            expect.append(("map", None))
    array, keep = _launch_ex.kernel_params(tuple(args))
    assert len(array) == len(args) == len(keep)
    for i, (c_type, value) in enumerate(expect):
        if c_type == "map":
            assert array[i] == m.address and ctypes.string_at(array[i], 128) == bytes(range(128))
        else:
            assert ctypes.cast(array[i], ctypes.POINTER(c_type)).contents.value == value, i
