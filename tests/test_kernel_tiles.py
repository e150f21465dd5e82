"""kernels/cuda/_tiles.py mirrors the prefill kernels' shared-memory sizes: the same variants as
the sources instantiate, and (where nvcc is on PATH) the same bytes as the C++ structs give."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kernels.cuda._tiles import PREFILL_SHRINK_TILES, ShrinkTiles, dynamic_smem_bytes, walk_smem_bytes

CSRC = Path(__file__).resolve().parent.parent / "kernels" / "csrc"


def _instances(source: str, macro: str) -> list[tuple[str, list[int]]]:
    text = (CSRC / source).read_text()
    return [(m[1], [int(v) for v in m[2].split(",")]) for m in re.finditer(rf"^{macro}\((\w+), ([\d, ]+)\)$", text, re.M)]


def test_shrink_variants_are_the_instantiated_ones() -> None:
    got = _instances("lora_shrink.cu", "LORA_SHRINK_KERNEL")
    assert len(got) == 2 * len(PREFILL_SHRINK_TILES)
    for name, (_dt, nc, bk, stages, warps) in got:
        assert name.endswith(f"_m128_r{nc}") and PREFILL_SHRINK_TILES[nc] == ShrinkTiles(nc, bk, stages, warps), name
        assert dynamic_smem_bytes(name) == ShrinkTiles(nc, bk, stages, warps).smem_bytes


def test_expand_variants_are_the_instantiated_ones() -> None:
    got = _instances("lora_expand.cu", "LORA_EXPAND_KERNEL")
    assert sorted(name for name, _ in got) == ["lora_expand_bf16_m128", "lora_expand_fp16_m128"]
    for name, _ in got:  # launched with the shared memory of the largest rank cap at most
        assert dynamic_smem_bytes(name) == walk_smem_bytes(128)
    assert walk_smem_bytes(16) < walk_smem_bytes(17) == walk_smem_bytes(32) < walk_smem_bytes(128)
    assert dynamic_smem_bytes("lora_expand_dec_bf16_m4") == 0


SIZES = r"""
#include <cstdio>
#include "lora_shrink.cu"
#include "lora_expand.cu"
int main() {
  std::printf("%d %d %d %d %d %d\n", ShrinkTiles<32, 64, 4, 4>::SMEM, ShrinkTiles<64, 64, 3, 8>::SMEM,
              ShrinkTiles<128, 64, 3, 8>::SMEM, 2 * walk_smem_elems(16), 2 * walk_smem_elems(64),
              2 * walk_smem_elems(128));
  return 0;
}
"""


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_mirrored_sizes_are_the_structs_sizes(tmp_path) -> None:
    src, exe = tmp_path / "sizes.cu", tmp_path / "sizes"
    src.write_text(SIZES)
    subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", f"-I{CSRC}", str(src), "-o", str(exe)], check=True,
                   timeout=600, capture_output=True)
    got = [int(v) for v in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()]
    want = [PREFILL_SHRINK_TILES[32].smem_bytes, PREFILL_SHRINK_TILES[64].smem_bytes,
            PREFILL_SHRINK_TILES[128].smem_bytes, walk_smem_bytes(16), walk_smem_bytes(64), walk_smem_bytes(128)]
    assert got == want
