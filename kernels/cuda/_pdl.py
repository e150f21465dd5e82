"""Programmatic dependent launch: a kernel that may start before the one ahead of it ends.

CuPy launches through ``cuLaunchKernel``, which has no launch attributes. This module calls
the driver's ``cuLaunchKernelEx`` (CUDA 12+) through ctypes with
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, for a kernel that follows another on
the same stream: its blocks may be scheduled as soon as every block of the kernel ahead has
run ``griddepcontrol.launch_dependents`` (or exited), and it must run ``griddepcontrol.wait``
before it reads what that kernel writes (the wait returns when the kernel ahead has completed
and its memory is visible). Launched without the attribute, the same kernel's wait returns at
once. Stream capture records the launch as a programmatic edge of the CUDA graph.

The ctypes structures mirror cuda.h's ``CUlaunchConfig`` and ``CUlaunchAttribute``
(tests/test_pdl_layout.py compares their layout with the C compiler's where cuda.h is present).
"""

from __future__ import annotations

import ctypes
import functools

import numpy as np

CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
MIN_COMPUTE_CAPABILITY = (9, 0)  # griddepcontrol: sm_90 and later


class LaunchAttributeValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("programmaticStreamSerializationAllowed", ctypes.c_int)]


class LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", LaunchAttributeValue)]


class LaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


_CTYPES = {np.dtype(np.int32): ctypes.c_int32, np.dtype(np.int64): ctypes.c_int64,
           np.dtype(np.uint64): ctypes.c_uint64, np.dtype(np.float32): ctypes.c_float}


def kernel_params(args: tuple) -> tuple[ctypes.Array, list]:
    """(void* array for cuLaunchKernelEx, the values it points at: keep them alive). Each
    argument is a NumPy scalar whose dtype is the kernel parameter's C type."""
    values = []
    for a in args:
        ctype = _CTYPES.get(a.dtype) if isinstance(a, np.generic) else None
        if ctype is None:
            raise TypeError(f"kernel argument {a!r}: not an int32/int64/uint64/float32 NumPy scalar")
        values.append(ctype(a.item()))
    return (ctypes.c_void_p * len(values))(*(ctypes.cast(ctypes.byref(v), ctypes.c_void_p) for v in values)), values


@functools.cache
def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.cuLaunchKernelEx.restype = ctypes.c_int
    return lib


def launch_after(function, grid: tuple, block: tuple, args: tuple, stream_handle: int) -> None:
    """Launch ``function`` (a ``cupy.RawKernel``, as ``RawModule.get_function`` gives it: its
    ``kernel`` is the current device's compiled ``Function``, whose ``ptr`` is the CUfunction) on
    the stream ``stream_handle`` as a programmatic dependent of the kernel ahead of it there."""
    attr = LaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value.programmaticStreamSerializationAllowed = 1
    grid = tuple(grid) + (1,) * (3 - len(grid))
    block = tuple(block) + (1,) * (3 - len(block))
    config = LaunchConfig(*grid, *block, 0, ctypes.c_void_p(stream_handle), ctypes.pointer(attr), 1)
    params, _keep = kernel_params(args)
    cu_function = function.kernel.ptr  # compiles for the current device on first use
    status = _driver().cuLaunchKernelEx(ctypes.byref(config), ctypes.c_void_p(cu_function), params, None)
    if status != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {status}")
