"""The CUDA wrappers' argument checks: the shared ones (kernels/checks.py) and what the
CUDA kernels add: CUDA tensors in bfloat16 or float16."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kernels.checks import Problem, check_row_slot, check_seg
from kernels.checks import check_args as check_shared

__all__ = ["Problem", "check_args", "check_row_slot", "check_seg"]

_DTYPES = (torch.bfloat16, torch.float16)


def check_args(
    y: torch.Tensor,
    x: torch.Tensor,
    pool: torch.Tensor,
    a_off: torch.Tensor,
    b_off: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    layer: int,
    out_widths: Sequence[int],
    workspace: torch.Tensor,
) -> Problem:
    """kernels.checks.check_args, for CUDA tensors of a dtype the kernels take."""
    if not x.is_cuda:
        raise ValueError(f"x: is on {x.device}; the CUDA kernels need CUDA tensors")
    if x.dtype not in _DTYPES:
        raise ValueError(f"x: dtype {x.dtype}; the CUDA kernels take bfloat16 or float16")
    return check_shared(y, x, pool, a_off, b_off, ranks, scales, layer, out_widths, workspace)
