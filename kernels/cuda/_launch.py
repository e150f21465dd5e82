"""Launch geometry and the two launches (shrink, expand) of one add_lora call.

Everything here depends on tensor *shapes* only (never on table contents), so a call
launches the same grids every time for the same shapes: what CUDA-graph replay needs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from loraplex.kernels.checks import Problem
from loraplex.kernels.cuda._launch_ex import launch_ex
from loraplex.kernels.cuda._runtime import DeviceRuntime
from loraplex.kernels.cuda._tensor_map import ZERO_MAP, TensorMap, encode_rows, map_fits
from loraplex.kernels.cuda import _tiles
from loraplex.kernels.cuda._tiles import PREFILL_SHRINK_TILES, SHRINK_BM, WALK_BN, walk_smem_bytes
from loraplex.kernels.operands import LoraOperands

THREADS = 128
TARGET_BLOCKS = 264  # decode: about two blocks per multiprocessor on an H200 (132 SMs)
# Up to this many rows (and always for BGMV): the decode path. As many as the engine's largest CUDA
# graph (MAX_GRAPH_ROWS): a graph step is a decode batch plus short prompt chunks, many one-row
# segments, and the prefill kernels take a 128-row tile for each segment.
SMALL_BATCH_ROWS = 512
# Longer SGMV calls (eager steps, whose seg has their own segments) take the decode kernels as well
# while their segments' mean rows times the rank cap (at least 16) stay under this: 24 rows at rank
# 16, 6 at rank 64. The prefill kernels cost about a tile a segment, the decode kernels about their
# rows times the rank. See docs/KERNELS.md, "Path choice".
DECODE_MAX_SEGMENT_ROW_RANKS = 384
K_GRAIN = 64  # split-K chunks are multiples of this many input features
MAX_KSPLIT = 16  # LORA_MAX_KSPLIT in lora_common.cuh
PREFILL_BM = SHRINK_BM  # prefill: rows per work item (the tensor-core kernels' row tile)
# The prefill kernels prefer shared memory over L1 (their copies bypass L1), so two blocks of each
# fit an SM (shrink 83-105 KB, expand 48-106 KB by the rank cap).
PREFILL_CARVEOUT = 100
# The prefill expand walks column tiles (lora_expand.cu): each block reads the item's v once and
# does `walk` tiles of WALK_BN columns, enough tiles that one wave of blocks covers the call, at
# most MAX_WALK; EXPAND_THREADS a block.
EXPAND_THREADS = 256
MAX_WALK = 32
# Prefill split-K blocks form one thread-block cluster per item and slice (sm_90+), whose blocks sum
# their partials in each other's shared memory: the portable cluster size bounds the split.
MAX_CLUSTER = 8  # LORA_MAX_CLUSTER in lora_cluster.cuh
DEC_ROWS = 4  # decode: rows per work item, shrink and expand (SHRINK_DEC_NR, DEC_ROWS in csrc)
# Decode SGMV calls of up to this many rows take one-row items in both kernels (the row's segment
# looked up by the block, or read from row_slot): a grouped batch then spreads over as many blocks
# as a Distinct one, where 4-row tiles leave most of the device idle. Past it the 4-row tiles win
# (fewer re-reads of each adapter). See docs/KERNELS.md, "One-row decode items".
ONE_ROW_ITEMS_ROWS = 64
MODE_SGMV, MODE_BGMV, MODE_SGMV_ROWS, MODE_RUNS = 0, 1, 2, 3  # LORA_MODE_* in lora_common.cuh
# Decode SGMV calls past ONE_ROW_ITEMS_ROWS rows that come with a row_slot (the engine's): the kernels
# of RUN_ITEMS ("shrink", "expand") take its runs as items (run_item in lora_common.cuh: each segment
# in 4-row tiles, found with one round of row_slot loads). Otherwise the expand takes one row per item
# (restaging its B tile for every row: at 128 rows of one adapter, 4x the L2 traffic of 4-row tiles)
# and the shrink seg's 4-row tiles (those past a segment's first scan the segments).
RUN_ITEMS = frozenset({"shrink", "expand"})
# Decode: input features per shrink block at most: 4 k-rows a thread, one batch of loads in
# flight. The grids do not depend on the rank (nor on the engine's rank cap), so a captured
# graph costs what its adapters' ranks cost: larger ranks take more passes per block.
DEC_KC = 512
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


def rank_variant(rank_cap: int, choices: tuple[int, ...]) -> str:
    """Kernel variant for ranks up to rank_cap: the smallest r<N> with N >= rank_cap."""
    return f"r{next((n for n in choices if rank_cap <= n), choices[-1])}"


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class Plan:
    """Grid of one call. mode MODE_SGMV (table = seg) or MODE_BGMV (table = row_slot).

    decode: a CUDA-core shrink (lora_shrink_dec) stores fp32 split-K partials and the CUDA-core
    expand (lora_expand_dec) sums them, both over items of DEC_ROWS rows, or of one row (bm = 1:
    BGMV, and SGMV calls of up to ONE_ROW_ITEMS_ROWS rows); otherwise (prefill) the last
    tensor-core shrink block of an item sums them into the workspace and the tensor-core expand
    reads the workspace.
    """

    mode: int
    ntable: int  # S for SGMV, T for BGMV
    decode: bool
    bm: int  # rows per work item (decode: 1 or DEC_ROWS; prefill: PREFILL_BM)
    items: int  # upper bound of work items (grid.y of both kernels); surplus blocks exit at once
    ksplit: int  # blocks splitting h_in in the shrink
    kc: int  # input features per shrink block

    def __post_init__(self) -> None:
        bm_ok = self.bm in (1, DEC_ROWS) if self.decode else self.bm == PREFILL_BM
        if self.mode not in (MODE_SGMV, MODE_BGMV) or not bm_ok or self.items < 1:
            raise ValueError(f"invalid launch plan {self}")
        if not 1 <= self.ksplit <= (MAX_KSPLIT if self.decode else MAX_CLUSTER):
            raise ValueError(f"invalid launch plan {self}")


def _item_bound(mode: int, rows: int, ntable: int, bm: int) -> int:
    # SGMV: one item per segment (its first tile) + its further tiles, < T/bm in all; rows: one each
    return rows if mode == MODE_BGMV or bm == 1 else ntable + _ceil(rows, bm)


def _prefill_tiles(rows: int, ntable: int, bm: int) -> int:
    """Most row tiles S segments of `rows` rows can need: each segment past the first may add a
    partly filled one. A table of one-row segments beside a prompt (a full batch admitting one)
    has a tile each: the split-K must not multiply those by what the rows alone would leave room
    for. A captured graph's table has its capacity: it is sized for the worst case."""
    return _ceil(rows, bm) + max(0, min(ntable, rows) - 1)


def is_decode(rows: int, mode: int, ntable: int, rank_cap: int) -> bool:
    """Whether a call takes the decode path (CUDA-core kernels over DEC_ROWS-row items): BGMV
    calls, calls of up to SMALL_BATCH_ROWS rows, and SGMV calls whose ntable segments' mean rows
    times the rank cap stay under DECODE_MAX_SEGMENT_ROW_RANKS."""
    if mode == MODE_BGMV or rows <= SMALL_BATCH_ROWS:
        return True
    return rows * max(rank_cap, 16) < DECODE_MAX_SEGMENT_ROW_RANKS * ntable


def make_plan(problem: Problem, mode: int, ntable: int, prefill_wave: int) -> Plan:
    """Path, row tile, work-item bounds and split-K of a call, from its shapes.

    prefill_wave: how many prefill shrink blocks the device runs at once (plan_call asks the
    driver; unused on the decode path). The prefill split-K fills one such wave and no more:
    more blocks only add fp32 partials for each item's last block to sum and a ragged second
    wave (docs/KERNELS.md, "Prefill split").
    """
    rows, nslices, h_in = problem.rows, len(problem.widths), problem.h_in
    decode = is_decode(rows, mode, ntable, problem.rank_cap)
    bm = (1 if mode == MODE_BGMV or rows <= ONE_ROW_ITEMS_ROWS else DEC_ROWS) if decode else PREFILL_BM
    items = _item_bound(mode, rows, ntable, bm)
    expected = (rows if bm == 1 else min(ntable, rows)) if decode else _prefill_tiles(rows, ntable, bm)
    if decode:  # about two blocks a multiprocessor, and each thread's loads of A in flight together
        ksplit = max(_ceil(TARGET_BLOCKS, max(1, expected) * nslices), _ceil(h_in, DEC_KC))
    else:
        ksplit = min(prefill_wave // (expected * nslices), MAX_CLUSTER)
    ksplit = max(1, min(ksplit, MAX_KSPLIT, _ceil(h_in, K_GRAIN)))
    kc = _ceil(_ceil(h_in, ksplit), K_GRAIN) * K_GRAIN
    return Plan(mode, ntable, decode, bm, items, _ceil(h_in, kc), kc)


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
    tiles = [_ceil(w, bn) for w in problem.widths]
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


def walk_count(widths: tuple[int, ...], rows: int, bm: int, wave: int) -> int:
    """Column tiles a prefill expand block takes: as many column groups an item as one wave of
    `wave` blocks holds over the call's items (whole groups: a ragged second wave costs more than
    longer walks), at most MAX_WALK tiles."""
    tiles = sum(_ceil(w, WALK_BN) for w in widths)
    groups = max(1, wave // _ceil(rows, bm))
    return max(1, min(MAX_WALK, _ceil(tiles, groups)))



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
