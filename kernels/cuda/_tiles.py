"""Shared-memory sizes of the prefill tensor-core kernels, mirrored from their C++ tile structs
(``ShrinkTiles`` in csrc/lora_shrink_stages.cuh, ``walk_smem_elems`` in csrc/lora_expand_tiles.cuh): the launcher
gives each block this much dynamic shared memory (and raises the kernel's limit to it), and the
kernels trap if they were given less, so a stale mirror fails loudly instead of overrunning.
tests/kernels/test_kernel_tiles.py checks the variants listed here against the kernels' instantiations."""

from __future__ import annotations

import re
from dataclasses import dataclass

SHRINK_BM = 128  # rows per item of both prefill kernels (SHRINK_BM / EXPAND_BM in csrc)


@dataclass(frozen=True, slots=True)
class ShrinkTiles:
    """Rank columns (nc), input features per stage (bk), stages and warps of one prefill shrink variant."""

    nc: int
    bk: int
    stages: int
    warps: int

    @property
    def smem_bytes(self) -> int:
        stage = SHRINK_BM * (self.bk + 8) + self.bk * (self.nc + 8)  # x tile + A tile, elements
        partial_tile = SHRINK_BM * (self.nc + 4) * 4  # fp32, over the stages after the loop
        return max(self.stages * stage * 2, partial_tile) + 1024  # from a 1024-byte boundary (the TMA swizzle)


# The prefill shrink's variant by the rank cap it covers (lora_shrink_<dtype>_m128_r<nc>), chosen by
# sweeps on the H200: see docs/KERNELS.md, "Prefill shrink tile sweep".
PREFILL_SHRINK_TILES = {32: ShrinkTiles(32, 64, 4, 4), 64: ShrinkTiles(64, 64, 4, 4),
                        128: ShrinkTiles(128, 64, 3, 8)}


WALK_BN = 64  # columns a tile of the prefill expand (lora_expand_tiles.cuh)


WALK_WG_MIN_RANK = 33  # ranks from here take the prefill expand's wgmma path on sm_90a (passed to the kernel)


def walk_smem_bytes(rank_cap: int) -> int:
    """The prefill expand's shared memory for ranks up to rank_cap (rounded up to 16), 16-bit
    elements (walk_smem_elems in csrc): the item's v rows, two B tiles and two y tiles, laid out
    for mma.sync (padded rows) or, for ranks from WALK_WG_MIN_RANK, for wgmma (from a 1024-byte
    boundary, v in 64-feature blocks, dense B rows): the larger of the two."""
    rpad = -(-rank_cap // 16) * 16
    y_tiles = 2 * SHRINK_BM * (WALK_BN + 8)
    mma = SHRINK_BM * (rpad + 8) + 2 * rpad * (WALK_BN + 8) + y_tiles
    wg = 512 + SHRINK_BM * (-(-rpad // 64) * 64) + 2 * rpad * WALK_BN + y_tiles
    return 2 * (mma if rpad < WALK_WG_MIN_RANK else max(mma, wg))


def dynamic_smem_bytes(kernel: str) -> int:
    """Dynamic shared memory a launch of the named kernel gives each block (0: none)."""
    if m := re.fullmatch(r"lora_shrink_(?:bf16|fp16)_m128_r(\d+)", kernel):
        return PREFILL_SHRINK_TILES[int(m[1])].smem_bytes
    if re.fullmatch(r"lora_expand_(?:bf16|fp16)_m128", kernel):  # at the largest rank cap
        return walk_smem_bytes(128)
    return 0
