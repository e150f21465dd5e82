"""Argument checks of the LoRA entry points, every backend: each problem a ValueError naming it.

Only shapes, dtypes, devices and strides are checked (host metadata, no device sync), so
the checks are cheap (~6 us a call) and safe inside CUDA-graph capture. Table *contents*
(offsets, ranks, segment bounds) are the backends' to handle: the CUDA kernels clamp them
(rows outside [0, T), slots outside the table and ranks outside 1..min(R, 128) are skipped);
on the CPU, torch's indexing refuses an offset outside the pool. The CUDA wrappers add their
own conditions (kernels/cuda/_checks.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loraplex.kernels.operands import LoraOperands

MAX_SLICES = 4
MAX_RANK = 128


@dataclass(frozen=True, slots=True)
class Problem:
    """Shape of one add_lora call, read off the validated tensors."""

    rows: int  # T
    h_in: int
    widths: tuple[int, ...]  # out_widths, one per slice
    nslots: int  # columns of the [P, S] tables
    rank_cap: int  # workspace R


def _fail(name: str, problem: str) -> None:
    raise ValueError(f"{name}: {problem}")


def _check_table(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...], dev) -> None:
    if t.device != dev:
        _fail(name, f"is on {t.device}, expected {dev} like x")
    if t.dtype != dtype:
        _fail(name, f"dtype {t.dtype}, expected {dtype}")
    if tuple(t.shape) != shape:
        _fail(name, f"shape {tuple(t.shape)}, expected {shape}")
    if not t.is_contiguous():
        _fail(name, "must be contiguous")


def _check_widths(out_widths: Sequence[int]) -> tuple[int, ...]:
    widths = tuple(int(w) for w in out_widths)
    if not 1 <= len(widths) <= MAX_SLICES:
        _fail("out_widths", f"{len(widths)} slices, expected 1..{MAX_SLICES}")
    if any(w <= 0 for w in widths):
        _fail("out_widths", f"every width must be positive, got {widths}")
    return widths


def check_args(y: torch.Tensor, x: torch.Tensor, ops: LoraOperands) -> Problem:
    """Validate everything but the batch table (seg / row_slot); return the problem shape."""
    pool, a_off, b_off, ranks, scales = ops.pool, ops.a_off, ops.b_off, ops.ranks, ops.scales
    layer, out_widths, workspace = ops.layer, ops.out_widths, ops.workspace
    dev = x.device
    if x.dim() != 2 or x.stride(1) != 1:
        _fail("x", f"must be 2-D [T, h_in] with contiguous rows, got shape {tuple(x.shape)} strides {x.stride()}")
    rows, h_in = x.shape
    widths = _check_widths(out_widths)
    for name, t in (("y", y), ("pool", pool), ("workspace", workspace)):
        if t.device != dev:
            _fail(name, f"is on {t.device}, expected {dev} like x")
        if t.dtype != x.dtype:
            _fail(name, f"dtype {t.dtype}, expected {x.dtype} like x")
    if y.dim() != 2 or tuple(y.shape) != (rows, sum(widths)) or y.stride(1) != 1:
        _fail("y", f"must be [T={rows}, sum(out_widths)={sum(widths)}] with contiguous rows, got shape "
              f"{tuple(y.shape)} strides {y.stride()}")
    if pool.dim() != 1 or not pool.is_contiguous():
        _fail("pool", "must be a contiguous 1-D tensor")
    if workspace.dim() != 3 or not workspace.is_contiguous():
        _fail("workspace", "must be a contiguous [P, T_cap, R] tensor")
    nslices = len(widths)
    if workspace.shape[0] != nslices or workspace.shape[1] < rows or workspace.shape[2] < 1:
        _fail("workspace", f"shape {tuple(workspace.shape)}, expected [P={nslices}, T_cap>={rows}, R>=1]")
    if a_off.dim() != 2:
        _fail("a_off", f"must be [P, S], got shape {tuple(a_off.shape)}")
    shape = (nslices, a_off.shape[1])
    _check_table("a_off", a_off, torch.int64, shape, dev)
    _check_table("b_off", b_off, torch.int64, shape, dev)
    _check_table("ranks", ranks, torch.int32, shape, dev)
    _check_table("scales", scales, torch.float32, shape, dev)
    if not isinstance(layer, int) or isinstance(layer, bool) or layer < 0:
        _fail("layer", f"must be a non-negative int, got {layer!r}")
    return Problem(rows, h_in, widths, shape[1], int(workspace.shape[2]))


def check_seg(seg: torch.Tensor, problem: Problem, dev: torch.device) -> None:
    """seg: int32 [S+1] contiguous, S at most the tables' column count (segment i uses column i;
    columns past S are not read)."""
    if seg.dim() != 1 or not 1 <= seg.shape[0] <= problem.nslots + 1:
        _fail("seg", f"shape {tuple(seg.shape)}, expected [S+1] with S <= {problem.nslots} (the tables' columns)")
    _check_table("seg", seg, torch.int32, tuple(seg.shape), dev)


def check_row_slot(row_slot: torch.Tensor, problem: Problem, dev: torch.device) -> None:
    """row_slot: int32 [T] contiguous."""
    _check_table("row_slot", row_slot, torch.int32, (problem.rows,), dev)
