"""TMA tensor maps (``CUtensorMap``, sm_90+) for the prefill shrink's x, made on the host through
the driver's ``cuTensorMapEncodeTiled`` (ctypes) and passed to the kernel by value.

A map names x's pointer, shape and row stride, so it depends on the tensor, not only on its
shape: a CUDA graph that captures a launch keeps the map of the x it was captured with, which is
what the graph's static buffers need. The enum values are cuda.h's (tests/kernels/test_tensor_map.py
compares them with the C compiler's where cuda.h is present).
"""

from __future__ import annotations

import ctypes
import functools

import torch

CU_TENSOR_MAP_DATA_TYPE = {torch.float16: 6, torch.bfloat16: 9}  # CU_TENSOR_MAP_DATA_TYPE_FLOAT16 / _BFLOAT16
CU_TENSOR_MAP_INTERLEAVE_NONE = 0
CU_TENSOR_MAP_SWIZZLE_128B = 3
CU_TENSOR_MAP_L2_PROMOTION_L2_256B = 3
CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE = 0  # elements outside the tensor read as zeros
MAP_BYTES, MAP_ALIGN = 128, 128  # sizeof / alignof(CUtensorMap)


class TensorMap:
    """One encoded map: 128 bytes at a 128-byte aligned address (``address``), kept alive here."""

    def __init__(self) -> None:
        self._buffer = ctypes.create_string_buffer(MAP_BYTES + MAP_ALIGN)
        base = ctypes.addressof(self._buffer)
        self.address = base + (-base) % MAP_ALIGN

    def raw(self) -> bytes:
        return ctypes.string_at(self.address, MAP_BYTES)


ZERO_MAP = TensorMap()  # passed where a launch takes no TMA path (the kernel never reads it)


def map_fits(x: torch.Tensor, box_cols: int) -> bool:
    """Whether x can be described: 2-D, 16-bit, rows that neither overlap nor repeat (a stride of
    at least a row; an expanded x keeps the cp.async copies) in 16-byte multiples under 2^40 bytes,
    a 16-byte aligned base, and rows of whole boxes in the swizzle span (box_cols x 2 bytes = 128)."""
    return (x.dim() == 2 and x.dtype in CU_TENSOR_MAP_DATA_TYPE and x.stride(1) == 1 and x.stride(0) % 8 == 0
            and x.stride(0) >= x.shape[1] and x.stride(0) * x.element_size() < 2**40 and x.data_ptr() % 16 == 0
            and box_cols * x.element_size() == 128 and x.shape[0] > 0)


def encode_rows(x: torch.Tensor, box_rows: int, box_cols: int) -> TensorMap:
    """The map of x [rows, cols] (row stride x.stride(0)) in boxes of box_rows x box_cols, with the
    128-byte swizzle (the shrink's ldmatrix addresses follow it). Raises if the driver refuses."""
    rows, cols = x.shape
    out = TensorMap()
    dims = (ctypes.c_uint64 * 2)(cols, rows)
    strides = (ctypes.c_uint64 * 1)(x.stride(0) * x.element_size())
    box = (ctypes.c_uint32 * 2)(box_cols, box_rows)
    steps = (ctypes.c_uint32 * 2)(1, 1)
    status = _driver().cuTensorMapEncodeTiled(
        ctypes.c_void_p(out.address), CU_TENSOR_MAP_DATA_TYPE[x.dtype], 2, ctypes.c_void_p(x.data_ptr()), dims,
        strides, box, steps, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
        CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)
    if status != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {status} for x {tuple(x.shape)} "
                           f"stride {x.stride(0)} {x.dtype}")
    return out


@functools.cache
def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    u64p, u32p = ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32)
    lib.cuTensorMapEncodeTiled.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, u64p, u64p,
                                           u32p, u32p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    lib.cuTensorMapEncodeTiled.restype = ctypes.c_int
    return lib
