"""Kernel launches with attributes, through the driver's ``cuLaunchKernelEx`` (CUDA 12+, ctypes):
CuPy launches through ``cuLaunchKernel``, which has none.

- Programmatic dependent launch (CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION), for a
  kernel that follows another on the same stream: its blocks may be scheduled as soon as every
  block of the kernel ahead has run ``griddepcontrol.launch_dependents`` (or exited), and it must
  run ``griddepcontrol.wait`` before it reads what that kernel writes (the wait returns when the
  kernel ahead has completed and its memory is visible). Launched without the attribute, the same
  kernel's wait returns at once. Stream capture records the launch as a programmatic edge of the
  CUDA graph.
- Thread-block clusters (CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION, sm_90+): the blocks of one
  cluster are scheduled together and read each other's shared memory.
- Dynamic shared memory (the launch's sharedMemBytes).

The ctypes structures mirror cuda.h's ``CUlaunchConfig`` and ``CUlaunchAttribute``
(tests/kernels/test_launch_ex_layout.py compares their layout with the C compiler's where cuda.h is present).
"""

from __future__ import annotations

import ctypes
import functools
import struct

import numpy as np

CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6
MIN_COMPUTE_CAPABILITY = (9, 0)  # griddepcontrol and clusters: sm_90 and later


class LaunchAttributeValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("programmaticStreamSerializationAllowed", ctypes.c_int),
                ("clusterDim", ctypes.c_uint * 3)]


class LaunchAttribute(ctypes.Structure):
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", LaunchAttributeValue)]


class LaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(LaunchAttribute)), ("numAttrs", ctypes.c_uint)]


# Each argument is packed into an 8-byte slot of one buffer (struct codes; 4-byte types padded).
_CODES = {np.dtype(np.int32): "i4x", np.dtype(np.int64): "q", np.dtype(np.uint64): "Q", np.dtype(np.float32): "f4x"}


def kernel_params(args: tuple) -> tuple[ctypes.Array, list]:
    """(void* array for cuLaunchKernelEx, what it points into, one entry an argument: keep them
    alive). Each argument is a NumPy scalar whose dtype is the kernel parameter's C type, packed
    into an 8-byte slot of one buffer, or an object with an ``address`` of the bytes of a by-value
    struct parameter (a TMA map: kernels/cuda/_tensor_map.py). One struct.pack_into for all the
    scalars: an eager step launches hundreds of kernels, and a ctypes object per argument cost
    ~43 us a launch of 28 arguments."""
    buf = ctypes.create_string_buffer(8 * max(1, len(args)))
    base = ctypes.addressof(buf)
    fmt, scalars, pointers, keep = ["="], [], [], []
    for i, a in enumerate(args):
        if hasattr(a, "address"):
            fmt.append("8x")
            pointers.append(a.address)
            keep.append(a)
            continue
        code = _CODES.get(a.dtype) if isinstance(a, np.generic) else None
        if code is None:
            raise TypeError(f"kernel argument {a!r}: not an int32/int64/uint64/float32 NumPy scalar")
        fmt.append(code)
        scalars.append(a)
        pointers.append(base + 8 * i)
        keep.append(buf)
    struct.pack_into("".join(fmt), buf, 0, *scalars)
    return (ctypes.c_void_p * len(pointers))(*pointers), keep


@functools.cache
def _driver() -> ctypes.CDLL:
    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuLaunchKernelEx.argtypes = [ctypes.POINTER(LaunchConfig), ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    lib.cuLaunchKernelEx.restype = ctypes.c_int
    return lib


def _dims(d: tuple) -> tuple:
    return tuple(d) + (1,) * (3 - len(d))


def launch_ex(function, grid: tuple, block: tuple, args: tuple, stream_handle: int, *, shared_mem: int = 0,
              cluster: tuple | None = None, programmatic: bool = False) -> None:
    """Launch ``function`` (a ``cupy.RawKernel``, as ``RawModule.get_function`` gives it: its
    ``kernel`` is the current device's compiled ``Function``, whose ``ptr`` is the CUfunction) on
    the stream ``stream_handle`` with ``shared_mem`` bytes of dynamic shared memory, in clusters of
    ``cluster`` blocks (each grid dimension a multiple of it), and as a programmatic dependent of
    the kernel ahead of it on the stream where ``programmatic``."""
    attrs = []
    if cluster is not None:
        attr = LaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION)
        attr.value.clusterDim[:] = _dims(cluster)
        attrs.append(attr)
    if programmatic:
        attr = LaunchAttribute(id=CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION)
        attr.value.programmaticStreamSerializationAllowed = 1
        attrs.append(attr)
    array = (LaunchAttribute * max(1, len(attrs)))(*attrs)
    config = LaunchConfig(*_dims(grid), *_dims(block), shared_mem, ctypes.c_void_p(stream_handle),
                          ctypes.cast(array, ctypes.POINTER(LaunchAttribute)), len(attrs))
    params, _keep = kernel_params(args)
    cu_function = function.kernel.ptr  # compiles for the current device on first use
    status = _driver().cuLaunchKernelEx(ctypes.byref(config), ctypes.c_void_p(cu_function), params, None)
    if status != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {status}")
