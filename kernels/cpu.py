"""SGMV on the CPU in float32/float64: the reference's arithmetic with fewer dispatches.

The reference (``loraplex.kernels.reference``) defines the semantics and is written for clarity;
on the CPU the per-segment Python and dispatch overhead is what costs (a decode step with
8 adapters runs 7 slices x 8 segments x 30 layers of tiny matmuls). This module computes
the same operations in the same order (so float32 results are bitwise the reference's):
tables are read once per call, and A/B are ``as_strided`` views of the pool.

A decode batch (every segment one row, all at one rank) runs each slice as two batched
products over A/B stacked per row (bitwise the reference where the BLAS's batched and single
products agree: MKL's AVX2 kernels; within float32 rounding on AVX-512). A ``DecodeStacks`` passed by the caller
(``loraplex.kernels.cpu_stacks``) keeps the stacks across steps and, when the batch changes, copies
only the adapters that changed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from loraplex.kernels.operands import LoraOperands
from loraplex.kernels.cpu_stacks import Assignment, DecodeLayout, DecodeStacks, SliceOperands, stack_rows

FAST_DTYPES = (torch.float32, torch.float64)


def add_lora_slices(y: torch.Tensor, x: torch.Tensor, ops: LoraOperands, seg: torch.Tensor,
                    stacks: DecodeStacks | None = None) -> None:
    """y[:, slice p][seg_i] += scale_pi * (x[seg_i] @ A_pi) @ B_pi   (same contract as the reference;
    ``ops.workspace`` is not needed here: each shrink result stays a temporary). ``stacks``: the
    caller's cache of decode-batch stacks and of the tables read (None: both on every call)."""
    pool, layer = ops.pool, ops.layer
    tables = (seg, ops.a_off, ops.b_off, ops.ranks, ops.scales)
    widths = tuple(ops.out_widths)
    plan = _remembered_plan(stacks, pool, x.shape[1], widths, tables)
    if plan.decode is not None:
        assignment, per_slice = None, None
        if stacks is not None:
            assignment, plan.token = stacks.assign(pool, plan.decode, plan.token)
            if assignment is not None:
                per_slice = stacks.operands(pool, plan.decode, assignment, layer)
        if per_slice is None:
            per_slice = stack_rows(pool, plan.decode, layer)
        _decode(y, x, plan.spans[0][1], per_slice, assignment, widths)
    h_in, spans, a_offs, b_offs, rks, scs = plan.h_in, plan.spans, plan.a_offs, plan.b_offs, plan.rks, plan.scs
    col = 0
    for p, width in enumerate(widths):
        if plan.batched[p]:
            col += width
            continue
        for i, lo, hi in spans:
            r = rks[p][i]
            if r == 0:
                continue
            a = pool.as_strided((h_in, r), (r, 1), a_offs[p][i] + layer * h_in * r)
            b = pool.as_strided((r, width), (width, 1), b_offs[p][i] + layer * r * width)
            delta = torch.mm(torch.mm(x[lo:hi], a), b)
            delta.mul_(scs[p][i])
            y[lo:hi, col : col + width].add_(delta)
        col += width


def _remembered_plan(stacks: DecodeStacks | None, pool: torch.Tensor, h_in: int, widths: tuple[int, ...],
                     tables: tuple[torch.Tensor, ...]) -> _Plan:
    if stacks is None:
        return _Plan(pool, h_in, widths, tables)
    try:
        sig = (h_in, widths, pool.data_ptr(), pool._version,
               *[(t.data_ptr(), t._version, t.shape, t.stride()) for t in tables])
    except RuntimeError:  # inference tensors have no write count: read them every time
        return _Plan(pool, h_in, widths, tables)
    return stacks.remember(sig, tables, lambda: _Plan(pool, h_in, widths, tables))


class _Plan:
    """One call's tables read into Python lists (once per step with ``DecodeStacks``)."""

    __slots__ = ("h_in", "spans", "a_offs", "b_offs", "rks", "scs", "batched", "decode", "token")

    def __init__(self, pool: torch.Tensor, h_in: int, widths: tuple[int, ...], tables: tuple[torch.Tensor, ...]) -> None:
        seg, a_off, b_off, ranks, scales = tables
        bounds = seg.tolist()
        self.h_in = h_in
        self.spans = [(i, bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1) if bounds[i + 1] > bounds[i]]
        self.a_offs, self.b_offs, self.rks, self.scs = a_off.tolist(), b_off.tolist(), ranks.tolist(), scales.tolist()
        self.batched = [_one_row_same_rank(self.spans, self.rks[p]) for p in range(len(widths))]
        self.decode = self._layout(pool.dtype, widths) if any(self.batched) else None
        self.token: tuple | None = None  # DecodeStacks.assign's, for the next layer of the same step

    def _layout(self, dtype: torch.dtype, widths: tuple[int, ...]) -> DecodeLayout:
        slots = [i for i, _, _ in self.spans]
        places = tuple(
            (self.rks[p][slots[0]], tuple(self.a_offs[p][i] for i in slots), tuple(self.b_offs[p][i] for i in slots),
             tuple(self.scs[p][i] for i in slots)) if self.batched[p] else None
            for p in range(len(widths)))
        return DecodeLayout(self.h_in, widths, places, dtype)


def _one_row_same_rank(spans: list[tuple[int, int, int]], ranks: list[int]) -> bool:
    """A decode batch: every segment one row, consecutive, all adapted at one rank."""
    if len(spans) < 2 or any(hi - lo != 1 for _, lo, hi in spans):
        return False
    first = ranks[spans[0][0]]
    return first > 0 and all(ranks[i] == first for i, _, _ in spans) and \
        spans[-1][1] - spans[0][1] == len(spans) - 1


def _decode(y: torch.Tensor, x: torch.Tensor, first: int, per_slice: list[SliceOperands | None],
            assignment: Assignment | None, widths: Sequence[int]) -> None:
    """Every batched slice's one-row segments in two batched products (bmm of 1-row operands
    gives the same floats as mm does per row with MKL's AVX2 kernels; its AVX-512 kernels sum
    in another order, within float32 rounding; multiplying by a scale of 1 changes nothing).
    The stacks are in slot order: x rows are gathered into it and the products put back in
    row order before the add (the same single addition per element)."""
    n = next(s.a.shape[0] for s in per_slice if s is not None)
    rows = x[first : first + n]
    permuted = assignment is not None and assignment.order is not None
    if permuted:
        rows = rows.index_select(0, assignment.order)
    col = 0
    for s, width in zip(per_slice, widths):
        if s is not None:
            delta = torch.bmm(torch.bmm(rows.unsqueeze(1), s.a), s.b).squeeze(1)
            if s.scale is not None:
                delta.mul_(s.scale)
            if permuted:
                delta = delta.index_select(0, assignment.slot_of)
            y[first : first + n, col : col + width].add_(delta)
        col += width
