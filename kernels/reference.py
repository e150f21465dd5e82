"""Plain-PyTorch reference of the LoRA kernels: the semantics every backend must match.

Adapter weights live in one flat pool tensor (1-D, the model's dtype). For adapter slot
``i`` and one projection, its A and B for every layer are stored contiguously, layer
major, so a single offset per slot serves every layer ("layer stride" = the size of one
layer's matrix, which follows from the slot's rank):

    A_i(layer) = pool[a_off[i] + layer*h_in*r_i  : + h_in*r_i ].view(h_in, r_i)
    B_i(layer) = pool[b_off[i] + layer*r_i*h_out : + r_i*h_out].view(r_i, h_out)

A batch of T rows is split into segments by ``seg`` (int32 [S+1], non-decreasing,
seg[0] = 0, seg[S] <= T); segment i uses slot i, and S is at most the slot tables' columns
(those past S are not read). Rank 0 means "no LoRA on this projection for this slot" and the
segment is skipped. Empty segments are allowed, so the tables can have a fixed capacity (what
lets a CUDA graph stay valid); a seg of the step's own S + 1 bounds sizes the CUDA kernels'
grids by the step's segments where nothing is captured.

    shrink:  v[seg[i]:seg[i+1], :r_i]  = x[seg[i]:seg[i+1]] @ A_i
    expand:  y[seg[i]:seg[i+1]]       += scale_i * (v[seg[i]:seg[i+1], :r_i] @ B_i)

BGMV has the same semantics with a row -> slot table instead of segments
(``row_slot`` int32 [T], -1 = no adapter).

Math is done in float32 (float64 for float64 inputs) and rounded once on write, the
way the CUDA kernels accumulate.
"""

from __future__ import annotations

import torch

from loraplex.kernels.operands import LoraOperands

__all__ = [
    "lora_shrink",
    "lora_expand",
    "bgmv_shrink",
    "bgmv_expand",
    "add_lora_slices",
    "add_lora_slices_bgmv",
]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _a_matrix(pool: torch.Tensor, off: int, layer: int, h_in: int, rank: int) -> torch.Tensor:
    start = off + layer * h_in * rank
    return pool[start : start + h_in * rank].view(h_in, rank)


def _b_matrix(pool: torch.Tensor, off: int, layer: int, h_out: int, rank: int) -> torch.Tensor:
    start = off + layer * rank * h_out
    return pool[start : start + rank * h_out].view(rank, h_out)


def _segments(seg: torch.Tensor) -> list[tuple[int, int, int]]:
    bounds = seg.tolist()
    return [(i, bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1) if bounds[i + 1] > bounds[i]]


def lora_shrink(
    v: torch.Tensor,
    x: torch.Tensor,
    pool: torch.Tensor,
    a_off: torch.Tensor,
    ranks: torch.Tensor,
    seg: torch.Tensor,
    layer: int,
) -> None:
    """v[seg[i]:seg[i+1], :r_i] = x[seg[i]:seg[i+1]] @ A_i(layer)   (in place on v)

    v: [T, R>=max r] out, x: [T, h_in], pool: [N] 1-D, a_off: int64 [S], ranks: int32 [S],
    seg: int32 [S+1]. Columns of v past r_i are left untouched.
    """
    h_in = x.shape[1]
    acc = _acc_dtype(x.dtype)
    offs, rks = a_off.tolist(), ranks.tolist()
    for i, lo, hi in _segments(seg):
        r = rks[i]
        if r == 0:
            continue
        a = _a_matrix(pool, offs[i], layer, h_in, r)
        v[lo:hi, :r] = (x[lo:hi].to(acc) @ a.to(acc)).to(v.dtype)


def lora_expand(
    y: torch.Tensor,
    v: torch.Tensor,
    pool: torch.Tensor,
    b_off: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    seg: torch.Tensor,
    layer: int,
) -> None:
    """y[seg[i]:seg[i+1]] += scale_i * (v[seg[i]:seg[i+1], :r_i] @ B_i(layer))   (in place on y)

    y: [T, h_out] (may be a column slice of a wider output), v: [T, R], pool: [N],
    b_off: int64 [S], ranks: int32 [S], scales: float32 [S], seg: int32 [S+1].
    """
    h_out = y.shape[1]
    acc = _acc_dtype(y.dtype)
    offs, rks, scs = b_off.tolist(), ranks.tolist(), scales.tolist()
    for i, lo, hi in _segments(seg):
        r = rks[i]
        if r == 0:
            continue
        b = _b_matrix(pool, offs[i], layer, h_out, r)
        delta = (v[lo:hi, :r].to(acc) @ b.to(acc)) * scs[i]
        y[lo:hi] = (y[lo:hi].to(acc) + delta).to(y.dtype)


def _row_segments(row_slot: torch.Tensor) -> list[tuple[int, int, int]]:
    return [(slot, row, row + 1) for row, slot in enumerate(row_slot.tolist()) if slot >= 0]


def bgmv_shrink(
    v: torch.Tensor,
    x: torch.Tensor,
    pool: torch.Tensor,
    a_off: torch.Tensor,
    ranks: torch.Tensor,
    row_slot: torch.Tensor,
    layer: int,
) -> None:
    """v[t, :r_s] = x[t] @ A_s(layer) with s = row_slot[t]; rows with s = -1 untouched.

    v: [T, R], x: [T, h_in], a_off: int64 [N_slots], ranks: int32 [N_slots], row_slot: int32 [T].
    """
    h_in = x.shape[1]
    acc = _acc_dtype(x.dtype)
    offs, rks = a_off.tolist(), ranks.tolist()
    for s, lo, hi in _row_segments(row_slot):
        r = rks[s]
        if r:
            v[lo:hi, :r] = (x[lo:hi].to(acc) @ _a_matrix(pool, offs[s], layer, h_in, r).to(acc)).to(v.dtype)


def bgmv_expand(
    y: torch.Tensor,
    v: torch.Tensor,
    pool: torch.Tensor,
    b_off: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    row_slot: torch.Tensor,
    layer: int,
) -> None:
    """y[t] += scale_s * (v[t, :r_s] @ B_s(layer)) with s = row_slot[t]; rows with s = -1 untouched."""
    h_out = y.shape[1]
    acc = _acc_dtype(y.dtype)
    offs, rks, scs = b_off.tolist(), ranks.tolist(), scales.tolist()
    for s, lo, hi in _row_segments(row_slot):
        r = rks[s]
        if r:
            b = _b_matrix(pool, offs[s], layer, h_out, r).to(acc)
            y[lo:hi] = (y[lo:hi].to(acc) + (v[lo:hi, :r].to(acc) @ b) * scs[s]).to(y.dtype)


def add_lora_slices(y: torch.Tensor, x: torch.Tensor, ops: LoraOperands, seg: torch.Tensor) -> None:
    """For each slice p: y[:, c_p:c_p+w_p][seg_i] += scale_pi * (x[seg_i] @ A_pi) @ B_pi

    The multi-slice form serves a fused projection (q/k/v with GQA widths, gate/up) in one
    call. y: [T, sum(out_widths)], x: [T, h_in]; seg: int32 [S+1]; ``ops`` as
    ``loraplex.kernels.operands.LoraOperands`` says (its workspace holds the shrink result, rounded to
    x's dtype exactly as the CUDA kernels do).
    """
    rows = x.shape[0]
    col = 0
    for p, width in enumerate(ops.out_widths):
        v = ops.workspace[p, :rows]
        lora_shrink(v, x, ops.pool, ops.a_off[p], ops.ranks[p], seg, ops.layer)
        lora_expand(y[:, col : col + width], v, ops.pool, ops.b_off[p], ops.ranks[p], ops.scales[p], seg, ops.layer)
        col += width


def add_lora_slices_bgmv(y: torch.Tensor, x: torch.Tensor, ops: LoraOperands, row_slot: torch.Tensor) -> None:
    """add_lora_slices with a row -> slot table (int32 [T], -1 = none) instead of segments."""
    rows = x.shape[0]
    col = 0
    for p, width in enumerate(ops.out_widths):
        v = ops.workspace[p, :rows]
        bgmv_shrink(v, x, ops.pool, ops.a_off[p], ops.ranks[p], row_slot, ops.layer)
        bgmv_expand(y[:, col : col + width], v, ops.pool, ops.b_off[p], ops.ranks[p], ops.scales[p], row_slot,
                    ops.layer)
        col += width
