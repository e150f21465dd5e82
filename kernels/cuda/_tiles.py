"""Shared-memory sizes of the prefill tensor-core kernels, mirrored from their C++ tile structs
(``ShrinkTiles`` in csrc/lora_shrink.cu, ``ExpandTiles`` in csrc/lora_expand.cu): the launcher
gives each block this much dynamic shared memory (and raises the kernel's limit to it), and the
kernels trap if they were given less, so a stale mirror fails loudly instead of overrunning.
tests/test_kernel_tiles.py checks the variants listed here against the kernels' instantiations."""

from __future__ import annotations

import re
from dataclasses import dataclass

SHRINK_BM = 128  # rows per item of both prefill kernels (SHRINK_BM / EXPAND_BM in csrc)
EXPAND_KC = 32  # rank rows per expand chunk


@dataclass(frozen=True, slots=True)
class ShrinkTiles:
    """Rank columns (nc), input features per stage (bk) and stages of one prefill shrink variant."""

    nc: int
    bk: int
    stages: int

    @property
    def smem_bytes(self) -> int:
        stage = SHRINK_BM * (self.bk + 8) + self.bk * (self.nc + 8)  # x tile + A tile, elements
        partial_tile = SHRINK_BM * (self.nc + 4) * 4  # fp32, over the stages after the loop
        return max(self.stages * stage * 2, partial_tile)


# The prefill shrink's variant by the rank cap it covers (lora_shrink_<dtype>_m128_r<nc>).
PREFILL_SHRINK_TILES = {32: ShrinkTiles(32, 64, 4), 64: ShrinkTiles(64, 64, 3), 128: ShrinkTiles(128, 32, 4)}


def expand_smem_bytes(bn: int) -> int:
    """ExpandTiles<bn>: the y tile and two rank chunks of v and of B, 16-bit elements."""
    return 2 * (SHRINK_BM * (bn + 8) + 2 * SHRINK_BM * (EXPAND_KC + 8) + 2 * EXPAND_KC * (bn + 8))


def dynamic_smem_bytes(kernel: str) -> int:
    """Dynamic shared memory a launch of the named kernel gives each block (0: none)."""
    if m := re.fullmatch(r"lora_shrink_(?:bf16|fp16)_m128_r(\d+)", kernel):
        return PREFILL_SHRINK_TILES[int(m[1])].smem_bytes
    if m := re.fullmatch(r"lora_expand_(?:bf16|fp16)_m128_n(\d+)", kernel):
        return expand_smem_bytes(int(m[1]))
    return 0
