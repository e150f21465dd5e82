"""The two launches (shrink, expand) of one add_lora call, over the grids of its Plan
(kernels/cuda/_plan.py), and the items each kernel reads.

Grids, kernels and arguments depend on tensor *shapes* and pointers only (never on table contents),
so a call launches the same way every time for the same tensors: what CUDA-graph replay needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from loraplex.kernels.checks import Problem
from loraplex.kernels.cuda._launch_ex import launch_ex
from loraplex.kernels.cuda._plan import (DEC_ROWS, MODE_BGMV, MODE_RUNS, MODE_SGMV, MODE_SGMV_ROWS, PREFILL_BM, Plan,
                                         ceil_div, is_decode, make_plan, rank_variant, walk_count)
from loraplex.kernels.cuda._runtime import DeviceRuntime
from loraplex.kernels.cuda._tensor_map import ZERO_MAP, TensorMap, encode_rows, map_fits
from loraplex.kernels.cuda import _tiles
from loraplex.kernels.cuda._tiles import PREFILL_SHRINK_TILES, WALK_BN, walk_smem_bytes
from loraplex.kernels.operands import LoraOperands

THREADS = 128
# The prefill kernels prefer shared memory over L1 (their copies bypass L1), so two blocks of each
# fit an SM (shrink 83-105 KB, expand 48-106 KB by the rank cap).
PREFILL_CARVEOUT = 100
# The prefill expand walks column tiles (lora_expand.cu): each block reads the item's v once and
# does `walk` tiles of WALK_BN columns, enough tiles that one wave of blocks covers the call, at
# most MAX_WALK (kernels/cuda/_plan.py, walk_count); EXPAND_THREADS a block.
EXPAND_THREADS = 256
# Decode SGMV calls past ONE_ROW_ITEMS_ROWS rows that come with a row_slot (the engine's): the kernels
# of RUN_ITEMS ("shrink", "expand") take its runs as items (run_item in lora_common.cuh: each segment
# in 4-row tiles, found with one round of row_slot loads). Otherwise the expand takes one row per item
# (restaging its B tile for every row: at 128 rows of one adapter, 4x the L2 traffic of 4-row tiles)
# and the shrink seg's 4-row tiles (those past a segment's first scan the segments).
RUN_ITEMS = frozenset({"shrink", "expand"})
DEC_COLS = 1024  # decode expand: columns per block (any rank: it walks the rank in 16-row chunks)
# The decode shrink that lets its expand start early prefers shared memory over L1 on its
# multiprocessors (cudaSharedmemCarveoutMaxShared): the expand's blocks (35 KB of shared memory
# each) are then placed beside the running shrink on every SM. With the default (L1) split they
# fit only on SMs that have drained, several to an SM, and the early start costs where with this it
# gains. The plain shrink keeps L1: its passes over rank columns re-read A there.
# See docs/KERNELS.md, "Decode shrink carve-out".
SHRINK_PDL_CARVEOUT = 100
SHRINK_DEC_RC = 16  # rank columns per pass of the decode shrink (lora_shrink_dec.cuh)
# The prefill split-K fills one wave of the shrink, and at most this many blocks a multiprocessor
# (and MAX_CLUSTER splits). The 128-row cluster kernels hold 2 blocks an SM at most (shared
# memory), and one is faster, as benchmarks/kernels/bench_prefill_tunables.py measures it.
# See docs/KERNELS.md, "Prefill split".
PREFILL_MAX_BLOCKS_PER_SM = 1
# sm_90: the prefill shrink's x tiles come by TMA (one copy a stage, kernels/cuda/_tensor_map.py)
# where x fits a tensor map; off (or elsewhere): the cp.async copies. TENSOR_MAPS_KEPT: maps kept
# a device, by x's pointer, shape, stride and dtype (an engine's activations come back).
SHRINK_TMA = True
TENSOR_MAPS_KEPT = 64
# sm_90: the prefill expand goes as its shrink's programmatic dependent (expand_follows_early).
PREFILL_PDL = True


def plan_call(rt: DeviceRuntime, problem: Problem, mode: int, ntable: int, dtype: torch.dtype) -> Plan:
    """make_plan with the device's prefill wave (a driver query, cached per kernel variant), at most
    PREFILL_MAX_BLOCKS_PER_SM blocks a multiprocessor."""
    wave = 0
    if not is_decode(problem.rows, mode, ntable, problem.rank_cap):
        kind, variant = shrink_kernel(True, problem.rank_cap)
        tiles = prefill_shrink_tiles(problem.rank_cap)
        wave = min(rt.resident_blocks(kind, dtype, variant, 32 * tiles.warps, tiles.smem_bytes, PREFILL_CARVEOUT),
                   PREFILL_MAX_BLOCKS_PER_SM * rt.sms)
    return make_plan(problem, mode, ntable, wave)


def shrink_kernel(prefill: bool, rank_cap: int, pdl: bool = False) -> tuple[str, str]:
    """(kind, variant) of the shrink. Decode: lora_shrink_dec, one variant for every rank (its
    grid may be captured in a graph), "_pdl" where the expand follows as its programmatic
    dependent; prefill: lora_shrink with the widest rank chunk the cap needs."""
    if not prefill:
        return "shrink_dec", f"m{DEC_ROWS}" + ("_pdl" if pdl else "")
    return "shrink", f"m{PREFILL_BM}_{rank_variant(rank_cap, tuple(PREFILL_SHRINK_TILES))}"


def prefill_shrink_tiles(rank_cap: int):
    """The tiles of the prefill shrink variant that serves ranks up to rank_cap."""
    return PREFILL_SHRINK_TILES[int(rank_variant(rank_cap, tuple(PREFILL_SHRINK_TILES))[1:])]


def _ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


@dataclass(frozen=True, slots=True)
class Call:
    """The tensors of one add_lora call."""

    y: torch.Tensor
    x: torch.Tensor
    ops: LoraOperands
    table: torch.Tensor  # seg (SGMV) or row_slot (BGMV)
    row_slot: torch.Tensor | None = None  # SGMV decode: one-row items read their slot from it


def _slice_args(plan: Plan, problem: Problem, bn: int) -> tuple[int, tuple]:
    """(column tiles in all, kernel arguments nslices, w0..w3, c0..c3, t1..t3)."""
    i32 = np.int32
    nslices = len(problem.widths)
    tiles = [ceil_div(w, bn) for w in problem.widths]
    starts = [sum(tiles[:i]) for i in range(nslices + 1)]
    widths = list(problem.widths) + [0] * (4 - nslices)
    cols = [sum(problem.widths[:i]) for i in range(nslices)] + [0] * (4 - nslices)
    t123 = (starts[1:] + [starts[-1]] * 4)[:3]
    return starts[-1], (i32(nslices), *(i32(v) for v in widths + cols + t123))


def launch(rt: DeviceRuntime, plan: Plan, problem: Problem, c: Call, only: str | None = None) -> None:
    """Shrink, then expand into y, on PyTorch's current stream (only = "shrink" / "expand":
    just that kernel, as the engine's split calls and the timing breakdowns use it).

    A decode call's expand may go as a programmatic dependent of its shrink (expand_follows_early):
    its blocks are placed, read their B and y and wait while the shrink finishes."""
    rows, cap = problem.rows, problem.rank_cap
    # fp32 partials: the decode path's, and the prefill split's where it cannot sum in a cluster
    global_partials = plan.decode or (plan.ksplit > 1 and not rt.clusters)
    partials, counters = rt.scratch(len(problem.widths) * plan.ksplit * rows * cap if global_partials else 0,
                                    len(problem.widths) * plan.items)
    pdl = expand_follows_early(plan, problem, only, rt.pdl)
    with rt.launching():
        if only != "expand":
            _launch_shrink(rt, plan, problem, c, partials, counters, pdl)
        if only != "shrink":
            _launch_expand(rt, plan, problem, c, partials, pdl)


def expand_follows_early(plan: Plan, problem: Problem, only: str | None, device_pdl: bool) -> bool:
    """Whether the expand goes as its shrink's programmatic dependent (with the shrink's carveout),
    for calls of both stages on a device that has it: decode calls whose ranks the shrink reads in
    one pass (rank cap <= SHRINK_DEC_RC; more passes re-read A through the L1 that the carveout
    gives away: docs/KERNELS.md, "Decode shrink carve-out"), and prefill
    calls where PREFILL_PDL (its blocks fetch their first y and B tiles while the shrink ends)."""
    if only is not None or not device_pdl:
        return False
    return problem.rank_cap <= SHRINK_DEC_RC if plan.decode else PREFILL_PDL


def _launch_shrink(rt: DeviceRuntime, plan: Plan, problem: Problem, c: Call, partials: torch.Tensor,
                   counters: torch.Tensor, pdl: bool) -> None:
    i32, i64 = np.int32, np.int64
    o = c.ops
    cap = problem.rank_cap
    table, ntable, mode, items = _shrink_items(plan, c, problem.rows)
    grid = (plan.ksplit, items, len(problem.widths))
    head = (_ptr(c.x), i64(c.x.stride(0)), _ptr(o.pool), _ptr(o.a_off), _ptr(o.ranks), _ptr(table),
            i32(ntable), i32(problem.nslots), i32(problem.rows), i32(problem.h_in), i32(o.layer))
    kind, variant = shrink_kernel(not plan.decode, cap, pdl)
    if plan.decode:  # fp32 partials only: the decode expand sums them
        shrink = rt.function(kind, c.x.dtype, variant, carveout=SHRINK_PDL_CARVEOUT if pdl else None)
        shrink(grid, (THREADS,), (*head, i32(cap), _ptr(partials), i32(plan.ksplit), i32(plan.kc), i32(mode)))
        return
    tiles = prefill_shrink_tiles(cap)
    smem = tiles.smem_bytes
    shrink = rt.function(kind, c.x.dtype, variant, carveout=PREFILL_CARVEOUT, smem=smem)
    cluster = rt.clusters and plan.ksplit > 1  # one cluster an item and slice (the kernel checks)
    args = (*head, _ptr(o.workspace), i64(o.workspace.shape[1] * cap), i32(cap), _ptr(partials),
            _ptr(counters), i32(plan.ksplit), i32(plan.kc), i32(items), i32(mode), i32(cluster),
            *_x_map(rt, c.x, tiles.bk))
    launch_ex(shrink, grid, (32 * tiles.warps,), args, torch.cuda.current_stream(c.x.device).cuda_stream,
              shared_mem=smem, cluster=(plan.ksplit, 1, 1) if cluster else None)


def _x_map(rt: DeviceRuntime, x: torch.Tensor, box_cols: int) -> tuple[TensorMap, np.int32]:
    """(the prefill shrink's x map, whether to use it): a kept map, or a new one."""
    if not (SHRINK_TMA and rt.tma and map_fits(x, box_cols)):
        return ZERO_MAP, np.int32(0)
    key = (x.data_ptr(), tuple(x.shape), x.stride(0), x.dtype)
    found = rt.tensor_maps.pop(key, None)
    if found is None:
        try:
            found = encode_rows(x, PREFILL_BM, box_cols)
        except RuntimeError:  # a layout the driver refuses where map_fits did not: the cp.async copies
            return ZERO_MAP, np.int32(0)
    rt.tensor_maps[key] = found  # the most recent last
    if len(rt.tensor_maps) > TENSOR_MAPS_KEPT:
        del rt.tensor_maps[next(iter(rt.tensor_maps))]
    return found, np.int32(1)


def _launch_expand(rt: DeviceRuntime, plan: Plan, problem: Problem, c: Call, partials: torch.Tensor,
                   pdl: bool) -> None:
    i32, i64 = np.int32, np.int64
    o = c.ops
    rows, cap = problem.rows, problem.rank_cap
    if not plan.decode:
        _launch_prefill_expand(rt, plan, problem, c, pdl)
        return
    ntiles, slices = _slice_args(plan, problem, DEC_COLS)
    tail = (i32(o.layer), _ptr(c.y), i64(c.y.stride(0)), *slices)
    # the expand's items: BGMV items (a row each) from row_slot where the call has one
    etable, entable, emode, eitems = _expand_items(plan, c, rows)
    expand = rt.function("expand_dec", c.x.dtype, f"m{DEC_ROWS}")
    args = (_ptr(partials), i32(plan.ksplit), i32(cap), _ptr(o.pool), _ptr(o.b_off), _ptr(o.ranks),
            _ptr(o.scales), _ptr(etable), i32(entable), i32(problem.nslots), i32(rows), *tail, i32(emode))
    if pdl:
        launch_ex(expand, (ntiles, eitems), (THREADS,), args, torch.cuda.current_stream(c.x.device).cuda_stream,
                  programmatic=True)
    else:
        expand((ntiles, eitems), (THREADS,), args)


def walk_tiles(rt: DeviceRuntime, plan: Plan, problem: Problem, dtype: torch.dtype) -> tuple[int, int]:
    """(column tiles a prefill expand block walks, its shared memory): one wave of blocks for the
    call's shapes."""
    smem = walk_smem_bytes(problem.rank_cap)
    wave = rt.resident_blocks("expand", dtype, f"m{plan.bm}", EXPAND_THREADS, smem, PREFILL_CARVEOUT)
    return walk_count(problem.widths, problem.rows, plan.bm, wave), smem



def _launch_prefill_expand(rt: DeviceRuntime, plan: Plan, problem: Problem, c: Call, pdl: bool) -> None:
    i32, i64 = np.int32, np.int64
    o = c.ops
    cap = problem.rank_cap
    walk, smem = walk_tiles(rt, plan, problem, c.x.dtype)
    groups, slices = _slice_args(plan, problem, WALK_BN * walk)
    expand = rt.function("expand", c.x.dtype, f"m{plan.bm}", carveout=PREFILL_CARVEOUT, smem=smem)
    args = (_ptr(o.workspace), i64(o.workspace.shape[1] * cap), i32(cap), _ptr(o.pool), _ptr(o.b_off),
            _ptr(o.ranks), _ptr(o.scales), _ptr(c.table), i32(plan.ntable), i32(problem.nslots),
            i32(problem.rows),
            i32(o.layer), _ptr(c.y), i64(c.y.stride(0)), *slices, i32(plan.mode), i32(walk),
            i32(_tiles.WALK_WG_MIN_RANK))
    launch_ex(expand, (groups, plan.items), (EXPAND_THREADS,), args,
              torch.cuda.current_stream(c.x.device).cuda_stream, shared_mem=smem, programmatic=pdl)


def _row_items(plan: Plan, c: Call, rows: int) -> tuple[torch.Tensor, int, int, int]:
    """One row per item: from row_slot where the call has one (BGMV items), else from seg."""
    if plan.mode == MODE_BGMV:
        return c.table, plan.ntable, MODE_BGMV, rows
    if c.row_slot is not None:
        return c.row_slot, rows, MODE_BGMV, rows
    return c.table, plan.ntable, MODE_SGMV_ROWS, rows


def _run_items(plan: Plan, c: Call, rows: int, kernel: str) -> tuple[torch.Tensor, int, int, int] | None:
    """row_slot's runs as 4-row items, for `kernel` if RUN_ITEMS has it, in a decode SGMV call of
    4-row tiles that has a row_slot; None otherwise."""
    if (kernel in RUN_ITEMS and plan.decode and plan.bm == DEC_ROWS and plan.mode == MODE_SGMV
            and c.row_slot is not None):
        return c.row_slot, rows, MODE_RUNS, rows
    return None


def _shrink_items(plan: Plan, c: Call, rows: int) -> tuple[torch.Tensor, int, int, int]:
    """The shrink's (table, ntable, mode, items): the plan's, with its one-row items (bm = 1) or
    row_slot's runs."""
    if plan.decode and plan.bm == 1:
        return _row_items(plan, c, rows)
    return _run_items(plan, c, rows, "shrink") or (c.table, plan.ntable, plan.mode, plan.items)


def _expand_items(plan: Plan, c: Call, rows: int) -> tuple[torch.Tensor, int, int, int]:
    """The expand's (table, ntable, mode, items): the shrink's, or on the decode path with a
    row_slot, its runs (RUN_ITEMS) or one row per item (BGMV items over the shrink's per-row
    partials, which do not depend on the shrink's items)."""
    if plan.decode and plan.bm == 1:
        return _row_items(plan, c, rows)
    runs = _run_items(plan, c, rows, "expand")
    if runs is not None:
        return runs
    if plan.decode and c.row_slot is not None:
        return _row_items(plan, c, rows)
    return c.table, plan.ntable, plan.mode, plan.items
