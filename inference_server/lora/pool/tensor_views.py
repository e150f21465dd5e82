"""Zero-copy tensor views over a safetensors file held in memory.

The loader thread reads adapter weights straight out of the bytes the source handed over
(no deserialisation copy, little time holding the GIL that the step loop needs); the
header was already checked by ``safetensors_header.read_header``.
"""

from __future__ import annotations

import struct
import warnings

import torch

from loraplex.adapter_store.format.safetensors_header import read_header

TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                "BOOL": torch.bool}


def tensor_views(data: bytes) -> dict[str, torch.Tensor]:
    """{name: read-only CPU tensor viewing ``data``} (little-endian hosts, as safetensors)."""
    tensors = read_header(data)
    base = 8 + struct.unpack("<Q", data[:8])[0]
    out = {}
    with warnings.catch_warnings():  # the views are never written: a read-only buffer is fine
        warnings.simplefilter("ignore", UserWarning)
        for name, info in tensors.items():
            dtype = TORCH_DTYPES[info.dtype]
            count = (info.end - info.begin) // torch.tensor([], dtype=dtype).element_size()
            flat = torch.frombuffer(data, dtype=dtype, count=count, offset=base + info.begin) if count else \
                torch.empty(0, dtype=dtype)
            out[name] = flat.view(info.shape)
    return out
