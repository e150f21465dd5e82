"""Launch geometry and the two launches (shrink, expand) of one add_lora call.

Everything here depends on tensor *shapes* only (never on table contents), so a call
launches the same grids every time for the same shapes: what CUDA-graph replay needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.cuda._checks import Problem
from kernels.cuda._runtime import DeviceRuntime

THREADS = 128
TARGET_BLOCKS = 264  # about two blocks per multiprocessor on an H200 (132 SMs)
SMALL_BATCH_ROWS = 256  # up to this many rows: 16-row tiles; above: 64-row tiles
K_GRAIN = 64  # split-K chunks are multiples of this many input features
EXPAND_BN = {16: 128, 64: 64}  # output columns per expand block, by row tile


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class Plan:
    """Grid of one call. mode 0 = SGMV (table = seg), 1 = BGMV (table = row_slot)."""

    mode: int
    ntable: int  # S for SGMV, T for BGMV
    bm: int  # rows per work item
    items: int  # upper bound of work items (grid.y); surplus blocks exit at once
    ksplit: int  # blocks splitting h_in in the shrink
    kc: int  # input features per shrink block

    def __post_init__(self) -> None:
        if self.mode not in (0, 1) or self.bm not in EXPAND_BN or self.items < 1 or self.ksplit < 1:
            raise ValueError(f"invalid launch plan {self}")


def make_plan(problem: Problem, mode: int, ntable: int) -> Plan:
    """Row tile, work-item bound and split-K of a call, from its shapes."""
    rows, nslices = problem.rows, len(problem.widths)
    bm = 16 if (mode == 1 or rows <= SMALL_BATCH_ROWS) else 64
    if mode == 0:
        # sum over non-empty segments of ceil(len/bm) <= T/bm + (number of non-empty segments)
        items = _ceil(rows, bm) + min(ntable, rows)
        expected = _ceil(rows, bm) if bm == 64 else min(ntable, rows)
    else:
        items = expected = rows
    ksplit = max(1, min(_ceil(TARGET_BLOCKS, max(1, expected) * nslices), _ceil(problem.h_in, K_GRAIN)))
    kc = _ceil(_ceil(problem.h_in, ksplit), K_GRAIN) * K_GRAIN
    return Plan(mode, ntable, bm, items, _ceil(problem.h_in, kc), kc)


def _ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


def launch(
    rt: DeviceRuntime,
    plan: Plan,
    problem: Problem,
    y: torch.Tensor,
    x: torch.Tensor,
    pool: torch.Tensor,
    a_off: torch.Tensor,
    b_off: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    table: torch.Tensor,
    layer: int,
    workspace: torch.Tensor,
) -> None:
    """Shrink into the workspace, then expand into y, both on PyTorch's current stream."""
    i32, i64 = np.int32, np.int64
    nslices, rows, cap = len(problem.widths), problem.rows, problem.rank_cap
    partials, counters = rt.scratch(nslices * plan.ksplit * rows * cap, nslices * plan.items)
    ws_pstride = i64(workspace.shape[1] * cap)
    shrink = rt.function("shrink", x.dtype, plan.bm)
    expand = rt.function("expand", x.dtype, plan.bm)
    bn = EXPAND_BN[plan.bm]
    tiles = [_ceil(w, bn) for w in problem.widths]
    starts = [sum(tiles[:i]) for i in range(len(tiles) + 1)]
    widths = list(problem.widths) + [0] * (4 - nslices)
    cols = [sum(problem.widths[:i]) for i in range(nslices)] + [0] * (4 - nslices)
    t123 = (starts[1:] + [starts[-1]] * 4)[:3]
    common = (i32(plan.ntable), i32(problem.nslots), i32(rows))
    with rt.stream():
        shrink(
            (plan.ksplit, plan.items, nslices),
            (THREADS,),
            (_ptr(x), i64(x.stride(0)), _ptr(pool), _ptr(a_off), _ptr(ranks), _ptr(table), *common,
             i32(problem.h_in), i32(layer), _ptr(workspace), ws_pstride, i32(cap), _ptr(partials),
             _ptr(counters), i32(plan.ksplit), i32(plan.kc), i32(plan.items), i32(plan.mode)),
        )
        expand(
            (starts[-1], plan.items),
            (THREADS,),
            (_ptr(workspace), ws_pstride, i32(cap), _ptr(pool), _ptr(b_off), _ptr(ranks), _ptr(scales),
             _ptr(table), *common, i32(layer), _ptr(y), i64(y.stride(0)), i32(nslices),
             *(i32(w) for w in widths), *(i32(c) for c in cols), *(i32(t) for t in t123), i32(plan.mode)),
        )
