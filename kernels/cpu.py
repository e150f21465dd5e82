"""SGMV on the CPU in float32/float64: the reference's arithmetic with fewer dispatches.

The reference (``kernels.reference``) defines the semantics and is written for clarity;
on the CPU the per-segment Python and dispatch overhead is what costs (a decode step with
8 adapters runs 7 slices x 8 segments x 30 layers of tiny matmuls). This module computes
the same operations in the same order (so float32 results are bitwise the reference's):
tables are read once per call, and A/B are ``as_strided`` views of the pool.
"""

from __future__ import annotations

from collections.abc import Sequence

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
) -> None:
    """y[:, slice p][seg_i] += scale_pi * (x[seg_i] @ A_pi) @ B_pi   (same contract as the reference;
    ``workspace`` is not needed here: each shrink result stays a temporary)."""
    bounds = seg.tolist()
    spans = [(i, bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1) if bounds[i + 1] > bounds[i]]
    h_in = x.shape[1]
    a_offs, b_offs, rks, scs = a_off.tolist(), b_off.tolist(), ranks.tolist(), scales.tolist()
    col = 0
    for p, width in enumerate(out_widths):
        if _one_row_same_rank(spans, rks[p]):
            _decode_slice(y, x, pool, a_offs[p], b_offs[p], rks[p], scs[p], spans, layer, col, width)
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


def _one_row_same_rank(spans: list[tuple[int, int, int]], ranks: list[int]) -> bool:
    """A decode batch: every segment one row, consecutive, all adapted at one rank."""
    if len(spans) < 2 or any(hi - lo != 1 for _, lo, hi in spans):
        return False
    first = ranks[spans[0][0]]
    return first > 0 and all(ranks[i] == first for i, _, _ in spans) and \
        spans[-1][1] - spans[0][1] == len(spans) - 1


def _decode_slice(
    y: torch.Tensor, x: torch.Tensor, pool: torch.Tensor, a_offs: list[int], b_offs: list[int],
    ranks: list[int], scales: list[float], spans: list[tuple[int, int, int]], layer: int, col: int, width: int,
) -> None:
    """All one-row segments of a slice in two batched products (bmm of 1-row operands gives the
    same floats as mm does per row); A/B are stacked copies of a few KB per row."""
    h_in, r = x.shape[1], ranks[spans[0][0]]
    first, n = spans[0][1], len(spans)
    a = torch.stack([pool.as_strided((h_in, r), (r, 1), a_offs[i] + layer * h_in * r) for i, _, _ in spans])
    b = torch.stack([pool.as_strided((r, width), (width, 1), b_offs[i] + layer * r * width) for i, _, _ in spans])
    delta = torch.bmm(torch.bmm(x[first : first + n].unsqueeze(1), a), b).squeeze(1)
    delta.mul_(torch.tensor([scales[i] for i, _, _ in spans], dtype=delta.dtype).unsqueeze(1))
    y[first : first + n, col : col + width].add_(delta)
