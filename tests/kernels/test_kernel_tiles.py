"""kernels/cuda/_tiles.py mirrors the prefill kernels' shared-memory sizes: the same variants as
the sources instantiate, and (where nvcc is on PATH) the same bytes as the C++ structs give."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from loraplex.kernels.cuda._tiles import PREFILL_SHRINK_TILES, ShrinkTiles, dynamic_smem_bytes, walk_smem_bytes

CSRC = Path(__file__).resolve().parents[2] / "kernels" / "csrc"


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


def _sizes_program() -> str:
    """C++ that prints the shrink variants' ShrinkTiles<...>::SMEM (in PREFILL_SHRINK_TILES order),
    then the expand's bytes at rank caps 16, 48, 64 and 128."""
    shrink = [f"ShrinkTiles<{t.nc}, {t.bk}, {t.stages}, {t.warps}>::SMEM" for t in PREFILL_SHRINK_TILES.values()]
    values = shrink + [f"2 * walk_smem_elems({r})" for r in (16, 48, 64, 128)]
    return ('#include <cstdio>\n#include "lora_shrink.cu"\n#include "lora_expand.cu"\nint main() {\n'
            + "".join(f'  std::printf("%d\\n", {v});\n' for v in values) + "  return 0;\n}\n")


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_mirrored_sizes_are_the_structs_sizes(tmp_path) -> None:
    src, exe = tmp_path / "sizes.cu", tmp_path / "sizes"
    src.write_text(_sizes_program())
    subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", f"-I{CSRC}", str(src), "-o", str(exe)], check=True,
                   timeout=600, capture_output=True)
    got = [int(v) for v in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()]
    want = [t.smem_bytes for t in PREFILL_SHRINK_TILES.values()] + [walk_smem_bytes(r) for r in (16, 48, 64, 128)]
    assert got == want
