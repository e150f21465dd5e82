"""Read and check a safetensors file's header without torch (used by validation and the store)."""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from loraplex.adapter_store.errors import AdapterValidationError

DTYPE_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
MAX_HEADER_BYTES = 100 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # byte offsets into the data section
    end: int


def read_header(data: bytes, filename: str = "adapter_model.safetensors",
                size: int | None = None) -> dict[str, TensorInfo]:
    """Parse and check a safetensors header: sizes, offsets, dtypes. Raises AdapterValidationError.
    ``size``: the whole file's size where ``data`` is only its head (at least 8 + the header)."""
    if size is not None and size < 8:
        raise AdapterValidationError(f"{filename}: declared {size} bytes, fewer than a safetensors file's 8-byte "
                                     f"header length: the declared size is wrong")
    if len(data) < 8:
        raise AdapterValidationError(f"{filename}: truncated (no header)")
    (n,) = struct.unpack("<Q", data[:8])
    if n > MAX_HEADER_BYTES or 8 + n > len(data):
        raise AdapterValidationError(f"{filename}: truncated or corrupt header (length {n}){_declared(size)}")
    try:
        header = json.loads(data[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise AdapterValidationError(f"{filename}: header is not valid JSON ({e})") from None
    except RecursionError:
        raise AdapterValidationError(f"{filename}: header nests too deeply (corrupt file)") from None
    if not isinstance(header, dict):
        raise AdapterValidationError(f"{filename}: header is not a JSON object")
    header.pop("__metadata__", None)
    data_len = (len(data) if size is None else size) - 8 - n
    try:
        tensors = {name: _tensor_info(name, entry, data_len, filename) for name, entry in header.items()}
        _check_coverage(tensors, data_len, filename)
    except AdapterValidationError as exc:
        raise AdapterValidationError(f"{exc}{_declared(size)}") from None
    return tensors


def _declared(size: int | None) -> str:
    """Where a file is judged by its declared size (an upload still on its way), what a misfit may mean."""
    return "" if size is None else f"; judged against the declared size of {size} bytes: the file or its size is wrong"


def _tensor_info(name: str, entry: object, data_len: int, filename: str) -> TensorInfo:
    try:
        dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]  # type: ignore[index]
    except (TypeError, KeyError, ValueError):
        raise AdapterValidationError(f"{filename}: malformed header entry for tensor {name!r}") from None
    if not isinstance(dtype, str) or not all(_is_index(v) for v in (begin, end)):
        raise AdapterValidationError(
            f"{filename}: tensor {name!r}: dtype must be a string and data_offsets two integers, "
            f"got {dtype!r} and {[begin, end]!r}")
    if dtype not in DTYPE_SIZES:
        raise AdapterValidationError(f"{filename}: tensor {name!r} has unsupported dtype {dtype}")
    if not all(_is_index(d) for d in shape):
        raise AdapterValidationError(f"{filename}: tensor {name!r} has an invalid shape {shape}")
    count = 1
    for d in shape:
        count *= d
    if not (0 <= begin <= end <= data_len) or end - begin != count * DTYPE_SIZES[dtype]:
        raise AdapterValidationError(
            f"{filename}: tensor {name!r} data offsets [{begin}, {end}) do not match its shape "
            f"{list(shape)} and dtype {dtype} within {data_len} data bytes (truncated or corrupt file)"
        )
    return TensorInfo(dtype, shape, begin, end)


def _is_index(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


# Floating-point dtypes: (little-endian word, exponent bits): all of them set is inf or NaN.
_EXPONENT_BITS = {"F32": ("<u4", 0x7F800000), "F16": ("<u2", 0x7C00), "BF16": ("<u2", 0x7F80)}


def non_finite_tensors(data: bytes, tensors: Mapping[str, TensorInfo]) -> list[str]:
    """The names (sorted) of the floating-point tensors of a checked safetensors file (``read_header``'s
    ``tensors``) that hold an infinity or a NaN."""
    (n,) = struct.unpack("<Q", data[:8])
    bad = []
    for name, t in tensors.items():
        if t.dtype not in _EXPONENT_BITS or t.end == t.begin:
            continue
        word, mask = _EXPONENT_BITS[t.dtype]
        words = np.frombuffer(data, dtype=word, count=(t.end - t.begin) // np.dtype(word).itemsize,
                              offset=8 + n + t.begin)
        if np.any((words & mask) == mask):
            bad.append(name)
    return sorted(bad)


def _check_coverage(tensors: dict[str, TensorInfo], data_len: int, filename: str) -> None:
    pos = 0
    for info in sorted(tensors.values(), key=lambda t: t.begin):
        if info.begin != pos:
            raise AdapterValidationError(f"{filename}: tensor data overlaps or has gaps (corrupt file)")
        pos = info.end
    if pos != data_len:
        raise AdapterValidationError(f"{filename}: {data_len - pos} trailing bytes after the tensors (corrupt file)")
