"""Launch geometry of one add_lora call: its path (decode or prefill kernels), row tile, work-item
bound and split-K, from tensor *shapes* only (never from table contents), so a call launches the same
grids every time for the same shapes: what CUDA-graph replay needs. The launches themselves, and the
items each kernel reads, are kernels/cuda/_launch.py's.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraplex.kernels.checks import Problem
from loraplex.kernels.cuda._tiles import SHRINK_BM, WALK_BN

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
MAX_WALK = 32  # column tiles a prefill expand block walks at most (walk_count)
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
# Decode: input features per shrink block at most: 4 k-rows a thread, one batch of loads in
# flight. The grids do not depend on the rank (nor on the engine's rank cap), so a captured
# graph costs what its adapters' ranks cost: larger ranks take more passes per block.
DEC_KC = 512


def rank_variant(rank_cap: int, choices: tuple[int, ...]) -> str:
    """Kernel variant for ranks up to rank_cap: the smallest r<N> with N >= rank_cap."""
    return f"r{next((n for n in choices if rank_cap <= n), choices[-1])}"


def ceil_div(a: int, b: int) -> int:
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
    return rows if mode == MODE_BGMV or bm == 1 else ntable + ceil_div(rows, bm)


def _prefill_tiles(rows: int, ntable: int, bm: int) -> int:
    """Most row tiles S segments of `rows` rows can need: each segment past the first may add a
    partly filled one. A table of one-row segments beside a prompt (a full batch admitting one)
    has a tile each: the split-K must not multiply those by what the rows alone would leave room
    for. A captured graph's table has its capacity: it is sized for the worst case."""
    return ceil_div(rows, bm) + max(0, min(ntable, rows) - 1)


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
        ksplit = max(ceil_div(TARGET_BLOCKS, max(1, expected) * nslices), ceil_div(h_in, DEC_KC))
    else:
        ksplit = min(prefill_wave // (expected * nslices), MAX_CLUSTER)
    ksplit = max(1, min(ksplit, MAX_KSPLIT, ceil_div(h_in, K_GRAIN)))
    kc = ceil_div(ceil_div(h_in, ksplit), K_GRAIN) * K_GRAIN
    return Plan(mode, ntable, decode, bm, items, ceil_div(h_in, kc), kc)


def walk_count(widths: tuple[int, ...], rows: int, bm: int, wave: int) -> int:
    """Column tiles a prefill expand block takes: as many column groups an item as one wave of
    `wave` blocks holds over the call's items (whole groups: a ragged second wave costs more than
    longer walks), at most MAX_WALK tiles."""
    tiles = sum(ceil_div(w, WALK_BN) for w in widths)
    groups = max(1, wave // ceil_div(rows, bm))
    return max(1, min(MAX_WALK, ceil_div(tiles, groups)))
