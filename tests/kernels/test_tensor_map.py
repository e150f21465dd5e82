"""kernels/cuda/_tensor_map.py without a GPU: cuda.h's enum values and sizes (where gcc and cuda.h
are present), which tensors a map may describe, and maps passed as by-value kernel parameters."""

from __future__ import annotations

import ctypes
import shutil

import numpy as np
import pytest
import torch

from loraplex.kernels.cuda import _launch_ex, _tensor_map
from c_probe import _cuda_include, c_probe

C_ENUMS = r"""
#include <cuda.h>
#include <stdio.h>
int main(void) {
  printf("%d %d %d %d %d %d %zu %zu\n", (int)CU_TENSOR_MAP_DATA_TYPE_FLOAT16, (int)CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
         (int)CU_TENSOR_MAP_INTERLEAVE_NONE, (int)CU_TENSOR_MAP_SWIZZLE_128B, (int)CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
         (int)CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE, sizeof(CUtensorMap), _Alignof(CUtensorMap));
  return 0;
}
"""


@pytest.mark.skipif(shutil.which("gcc") is None or _cuda_include() is None, reason="needs gcc and cuda.h")
def test_enum_values_and_map_size_are_cuda_h_s(tmp_path) -> None:
    c = c_probe(C_ENUMS, tmp_path)
    m = _tensor_map
    assert c[:7] == [m.CU_TENSOR_MAP_DATA_TYPE[torch.float16], m.CU_TENSOR_MAP_DATA_TYPE[torch.bfloat16],
                     m.CU_TENSOR_MAP_INTERLEAVE_NONE, m.CU_TENSOR_MAP_SWIZZLE_128B, m.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                     m.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE, m.MAP_BYTES]
    assert m.MAP_ALIGN % c[7] == 0 and m.MAP_ALIGN >= 64  # cuda.h 13 says 128, 12.x 64


def test_a_map_lies_at_an_aligned_address() -> None:
    maps = [_tensor_map.TensorMap() for _ in range(8)]
    assert all(m.address % _tensor_map.MAP_ALIGN == 0 for m in maps)
    assert _tensor_map.ZERO_MAP.raw() == bytes(_tensor_map.MAP_BYTES)


def test_only_16_bit_rows_of_16_byte_multiples_and_whole_swizzle_spans_fit() -> None:
    x = torch.zeros(256, 4096 + 8, dtype=torch.bfloat16)
    assert _tensor_map.map_fits(x[:, :4096], 64)  # a row-strided view: the stride is a multiple of 8
    assert not _tensor_map.map_fits(x[:, :4096], 32)  # 64 bytes: not the 128-byte swizzle span
    assert not _tensor_map.map_fits(torch.zeros(256, 4100, dtype=torch.bfloat16)[:, :4096], 64)  # stride 4100
    assert not _tensor_map.map_fits(x[:, 1:4097], 64)  # a base off 16 bytes
    assert not _tensor_map.map_fits(torch.zeros(256, 4096), 64)  # float32
    assert not _tensor_map.map_fits(torch.zeros(0, 4096, dtype=torch.float16), 64)
    assert not _tensor_map.map_fits(torch.zeros(1, 4096, dtype=torch.float16).expand(256, 4096), 64)  # stride 0
    assert not _tensor_map.map_fits(torch.zeros(8192, dtype=torch.float16).as_strided((256, 4096), (8, 1)), 64)


def test_a_map_goes_to_the_kernel_as_the_bytes_at_its_address() -> None:
    m = _tensor_map.TensorMap()
    ctypes.memmove(m.address, bytes(range(128)), 128)
    array, keep = _launch_ex.kernel_params((np.int32(7), m))
    assert array[1] == m.address and keep[1] is m
    assert ctypes.string_at(array[1], 128) == bytes(range(128))
