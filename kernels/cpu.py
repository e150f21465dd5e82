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
