"""SGMV on the CPU in float32/float64: the reference's arithmetic with fewer dispatches.

The reference (``kernels.reference``) defines the semantics and is written for clarity;
on the CPU the per-segment Python and dispatch overhead is what costs (a decode step with
8 adapters runs 7 slices x 8 segments x 30 layers of tiny matmuls). This module computes
the same operations in the same order (so float32 results are bitwise the reference's):
tables are read once per call, and A/B are ``as_strided`` views of the pool.

A decode batch (every segment one row, all at one rank) runs each slice as two batched
products over A/B stacked per row. Stacking copies the batch's adapters, so a
``DecodeStacks`` passed by the caller keeps the stacks across steps while the batch's
adapters, their pool places and the pool's contents stay the same (consecutive decode
steps of the same requests).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

FAST_DTYPES = (torch.float32, torch.float64)


def add_lora_slices(
    y: torch.Tensor,
    x: torch.Tensor,
    pool: torch.Tensor,
    a_off: torch.Tensor,
    b_off: torch.Tensor,
    ranks: torch.Tensor,
    scales: torch.Tensor,
    seg: torch.Tensor,
    layer: int,
    out_widths: Sequence[int],
    workspace: torch.Tensor,
    stacks: DecodeStacks | None = None,
) -> None:
    """y[:, slice p][seg_i] += scale_pi * (x[seg_i] @ A_pi) @ B_pi   (same contract as the reference;
    ``workspace`` is not needed here: each shrink result stays a temporary). ``stacks``: the
    caller's cache of decode-batch stacks and of the tables read (None: both on every call)."""
    tables = (seg, a_off, b_off, ranks, scales)
    widths = tuple(out_widths)
    plan = stacks.plan(pool, x.shape[1], widths, tables) if stacks is not None else _Plan(pool, x.shape[1], widths, tables)
    if plan.decode is not None:
        per_slice = stacks.get(plan, layer) if stacks is not None else plan.decode.stack(layer)
        _decode(y, x, plan.spans[0][1], per_slice, widths)
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


class _Plan:
    """One call's tables read into Python lists (once per step with ``DecodeStacks``)."""

    __slots__ = ("h_in", "spans", "a_offs", "b_offs", "rks", "scs", "batched", "decode", "stacks")

    def __init__(self, pool: torch.Tensor, h_in: int, widths: tuple[int, ...], tables: tuple[torch.Tensor, ...]) -> None:
        seg, a_off, b_off, ranks, scales = tables
        bounds = seg.tolist()
        self.h_in = h_in
        self.spans = [(i, bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1) if bounds[i + 1] > bounds[i]]
        self.a_offs, self.b_offs, self.rks, self.scs = a_off.tolist(), b_off.tolist(), ranks.tolist(), scales.tolist()
        self.batched = [_one_row_same_rank(self.spans, self.rks[p]) for p in range(len(widths))]
        self.decode = _DecodeTables(pool, h_in, widths, self) if any(self.batched) else None
        self.stacks: dict[int, list[_Stack | None]] | None = None  # the decode stacks by layer (DecodeStacks)


def _one_row_same_rank(spans: list[tuple[int, int, int]], ranks: list[int]) -> bool:
    """A decode batch: every segment one row, consecutive, all adapted at one rank."""
    if len(spans) < 2 or any(hi - lo != 1 for _, lo, hi in spans):
        return False
    first = ranks[spans[0][0]]
    return first > 0 and all(ranks[i] == first for i, _, _ in spans) and \
        spans[-1][1] - spans[0][1] == len(spans) - 1


@dataclass(frozen=True, slots=True)
class _Stack:
    """One slice of one layer: A [n, h_in, r], B [n, r, w], the rows' scales [n, 1] (None: all 1)."""

    a: torch.Tensor
    b: torch.Tensor
    scale: torch.Tensor | None


class _DecodeTables:
    """One call's decode batch: the pool places it reads per batched slice, and their stacks."""

    def __init__(self, pool: torch.Tensor, h_in: int, widths: tuple[int, ...], plan: _Plan) -> None:
        self.pool, self.h_in, self.widths = pool, h_in, widths
        slots = [i for i, _, _ in plan.spans]
        self.places = tuple(
            (plan.rks[p][slots[0]], tuple(plan.a_offs[p][i] for i in slots), tuple(plan.b_offs[p][i] for i in slots),
             tuple(plan.scs[p][i] for i in slots)) if plan.batched[p] else None
            for p in range(len(widths)))

    def key(self) -> tuple | None:
        """Same key, same stacks: the pool (and its write count), the shapes and the places.
        None for a pool without a write count (created in inference mode): never cached."""
        pool = self.pool
        try:
            version = pool._version
        except RuntimeError:
            return None
        return (pool.data_ptr(), version, pool.dtype, self.h_in, self.widths, self.places)

    def stack(self, layer: int) -> list[_Stack | None]:
        h_in, pool = self.h_in, self.pool
        out: list[_Stack | None] = []
        for place, width in zip(self.places, self.widths):
            if place is None:
                out.append(None)
                continue
            r, a_offs, b_offs, scs = place
            a = torch.stack([pool.as_strided((h_in, r), (r, 1), off + layer * h_in * r) for off in a_offs])
            b = torch.stack([pool.as_strided((r, width), (width, 1), off + layer * r * width) for off in b_offs])
            scale = None if all(s == 1.0 for s in scs) else torch.tensor(scs, dtype=pool.dtype).unsqueeze(1)
            out.append(_Stack(a, b, scale))
        return out


def _decode(
    y: torch.Tensor, x: torch.Tensor, first: int, per_slice: list[_Stack | None], widths: Sequence[int]
) -> None:
    """Every batched slice's one-row segments in two batched products (bmm of 1-row operands
    gives the same floats as mm does per row; multiplying by a scale of 1 changes nothing)."""
    col = 0
    for s, width in zip(per_slice, widths):
        if s is not None:
            n = s.a.shape[0]
            delta = torch.bmm(torch.bmm(x[first : first + n].unsqueeze(1), s.a), s.b).squeeze(1)
            if s.scale is not None:
                delta.mul_(s.scale)
            y[first : first + n, col : col + width].add_(delta)
        col += width


class DecodeStacks:
    """Stacked A/B of decode batches and the tables read, kept across calls and steps (owned
    by the caller, one per pool).

    Stacks are keyed by the pool's places of the batch's adapters and the pool's write
    count (``Tensor._version``, bumped by every in-place write, e.g. an adapter loaded into
    a freed place), so a changed batch or pool never reads a stale stack. At most
    ``max_entries`` fused projections' stacks are kept (4 = one batch's q/k/v, o, gate/up
    and down), so the memory held is about one copy of one batch's adapters.

    The tables read (``seg``, offsets, ranks, scales) are kept per table tensors and their
    write counts, so the 30 layers of a step read them once; the plans hold the tensors, so
    their memory is not reused while a plan could match.
    """

    def __init__(self, max_entries: int = 4) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self._entries: dict[tuple, dict[int, list[_Stack | None]]] = {}
        self._plans: dict[tuple, tuple[_Plan, tuple[torch.Tensor, ...]]] = {}
        self.builds = 0  # layers stacked (misses), for tests and profiling

    def plan(self, pool: torch.Tensor, h_in: int, widths: tuple[int, ...], tables: tuple[torch.Tensor, ...]) -> _Plan:
        try:
            sig = (h_in, widths, pool.data_ptr(), pool._version,
                   *[(t.data_ptr(), t._version, t.shape, t.stride()) for t in tables])
        except RuntimeError:  # inference tensors have no write count: read them every time
            return _Plan(pool, h_in, widths, tables)
        found = self._plans.get(sig)
        if found is not None:
            return found[0]
        if len(self._plans) >= 2 * self.max_entries:
            del self._plans[next(iter(self._plans))]
        plan = _Plan(pool, h_in, widths, tables)
        self._plans[sig] = (plan, tables)
        return plan

    def get(self, plan: _Plan, layer: int) -> list[_Stack | None]:
        """The stacks of ``plan``'s decode batch at ``layer`` (stacked on first use)."""
        if plan.stacks is None:
            key = plan.decode.key()
            if key is None:
                return plan.decode.stack(layer)
            layers = self._entries.get(key)
            if layers is None:
                while len(self._entries) >= self.max_entries:
                    self._evict_oldest()
                layers = self._entries[key] = {}
            plan.stacks = layers
        per_slice = plan.stacks.get(layer)
        if per_slice is None:
            per_slice = plan.stacks[layer] = plan.decode.stack(layer)
            self.builds += 1
        return per_slice

    def _evict_oldest(self) -> None:
        layers = self._entries.pop(next(iter(self._entries)))
        for plan, _ in self._plans.values():  # no plan keeps the evicted stacks alive
            if plan.stacks is layers:
                plan.stacks = None

    def clear(self) -> None:
        self._entries.clear()
        self._plans.clear()
