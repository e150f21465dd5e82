"""What the CUDA wrappers check beyond the shared argument checks (kernels/checks.py): CUDA
tensors in a dtype the kernels take."""

from __future__ import annotations

import torch

_DTYPES = (torch.bfloat16, torch.float16)


def check_cuda(x: torch.Tensor) -> None:
    """x on a CUDA device, in bfloat16 or float16 (the other tensors must match it: checks.py)."""
    if not x.is_cuda:
        raise ValueError(f"x: is on {x.device}; the CUDA kernels need CUDA tensors")
    if x.dtype not in _DTYPES:
        raise ValueError(f"x: dtype {x.dtype}; the CUDA kernels take bfloat16 or float16")
