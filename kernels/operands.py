"""The operands of a LoRA kernel call besides y, x and the row layout, as one value.

Every backend (reference, CPU, CUDA) takes the same ``LoraOperands``: where each (slice,
slot) adapter's A and B start in the pool, its rank and scale, the layer, the slices' output
widths, and the shrink's scratch. Callers build one a projection group; only the row layout
(``seg`` for SGMV, ``row_slot`` for BGMV) is passed beside it, since it is what tells the two
apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class LoraOperands:
    """pool: [N] 1-D contiguous, x's dtype, every adapter's A and B for every layer.
    a_off, b_off: int64 [P, S] element offsets of layer 0's A [h_in, r] / B [r, w_p] (layer l
    at off + l*h_in*r / off + l*r*w_p). ranks: int32 [P, S] (0 = slot not adapted for that
    slice). scales: float32 [P, S]. layer: int >= 0. out_widths: P <= 4 positive ints, the
    widths of y's column slices. workspace: [P, T_cap >= T, R] contiguous, x's dtype, the
    shrink's scratch; R bounds the ranks."""

    pool: torch.Tensor
    a_off: torch.Tensor
    b_off: torch.Tensor
    ranks: torch.Tensor
    scales: torch.Tensor
    layer: int
    out_widths: tuple[int, ...]
    workspace: torch.Tensor
