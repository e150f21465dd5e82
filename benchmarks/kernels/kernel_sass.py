"""What the LoRA kernels compile to on sm_90, without a GPU: each launched variant's registers,
spills, shared memory and SASS instruction mix, and the grids the launch plans give for the
bench_add_lora cases. For reading a kernel's time against its roofline (RESULTS.md, "from the
disassembly").

Needs nvcc and cuobjdump (``pip install nvidia-cuda-cuobjdump`` puts one under
site-packages/nvidia/cu13/bin, which this script finds). The kernels are compiled as the
runtime's NVRTC does (``-std=c++17``, the device's arch), from kernels/csrc with its headers.

    python -m benchmarks.kernels.kernel_sass [--arch sm_90] [--cuobjdump PATH]
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks import ROOT

from loraplex.kernels.checks import Problem
from loraplex.kernels.cuda import _launch, _plan
from loraplex.kernels.cuda._tiles import PREFILL_SHRINK_TILES, WALK_BN, dynamic_smem_bytes, walk_smem_bytes

CSRC = ROOT / "kernels" / "csrc"
SOURCES = ("lora_shrink_dec.cu", "lora_shrink.cu", "lora_expand_dec.cu", "lora_expand.cu")
OPCODES = ("LDG", "LDGSTS", "LDS", "LDS.U16", "STS", "STG", "HMMA", "FFMA", "BAR", "MEMBAR", "ATOMG", "S2R")
# name, rows, segments (adapters), rank, mode (0 SGMV, 1 BGMV): bench_add_lora's cases at h = 4096
CASES = (("B1 Distinct", 1, 1, 16, 0), ("B64 Distinct", 64, 64, 16, 0), ("B64 Distinct BGMV", 64, 64, 16, 1),
         ("B64 Identical", 64, 1, 16, 0), ("prefill T=4096 r16", 4096, 1, 16, 0),
         ("prefill T=4096 r64 (8 x 512)", 4096, 8, 64, 0), ("prefill T=4096 r128 (4 x 1024)", 4096, 4, 128, 0))


@dataclass
class Entry:
    registers: int = 0
    smem: int = 0
    spill_bytes: int = 0
    sass: tuple[str, ...] = ()


def ptxas_entries(stderr: str) -> dict[str, Entry]:
    """Per entry function, from ``nvcc -Xptxas -v``: registers, static shared memory, spills (the
    entry's own "Function properties" line: those of the device functions it calls follow it too)."""
    entries: dict[str, Entry] = {}
    entry = props = None
    for line in stderr.splitlines():
        if m := re.search(r"Compiling entry function '(\w+)'", line):
            entry = entries.setdefault(m.group(1), Entry())
        elif m := re.search(r"Function properties for (\w+)", line):
            props = m.group(1)
        elif entry and props in entries and entries[props] is entry and (
                m := re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)):
            entry.spill_bytes = int(m.group(1)) + int(m.group(2))
        elif entry and (m := re.search(r"Used (\d+) registers", line)):
            entry.registers = int(m.group(1))
            smem = re.search(r"(\d+) bytes smem", line)
            entry.smem = int(smem.group(1)) if smem else 0
    return entries


def opcodes(sass: str) -> tuple[str, ...]:
    """The opcode (with its modifiers) of every instruction in a ``cuobjdump -sass`` listing."""
    ops = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if m:
            ops.append(re.sub(r"^@!?U?P\w+\s+", "", m.group(1)).split()[0])
    return tuple(ops)


def mix(ops: tuple[str, ...]) -> dict[str, int]:
    """Instructions per opcode family (LDS counts every shared load, LDS.U16 the 16-bit ones again)."""
    counts = dict.fromkeys(OPCODES, 0)
    for op in ops:
        base = op.split(".")[0]
        if base in counts:
            counts[base] += 1
        if op.startswith("LDS.U16"):
            counts["LDS.U16"] += 1
    return counts


def compile_cubin(source: str, arch: str, cubin: Path) -> dict[str, Entry]:
    """Compile ``source`` (kernels/csrc) to ``cubin`` as the runtime does; ptxas's report per entry."""
    proc = subprocess.run(["nvcc", "-cubin", f"-arch={arch}", "-std=c++17", "-Xptxas", "-v", f"-I{CSRC}",
                           str(CSRC / source), "-o", str(cubin)], capture_output=True, text=True, check=True,
                          timeout=300)
    return ptxas_entries(proc.stderr)


def compile_source(source: str, arch: str, cuobjdump: str, work: Path) -> dict[str, Entry]:
    """``compile_cubin``'s entries with their SASS opcodes."""
    cubin = work / (Path(source).stem + ".cubin")
    entries = compile_cubin(source, arch, cubin)
    for name, entry in entries.items():
        listing = subprocess.run([cuobjdump, "-sass", "-fun", name, str(cubin)], capture_output=True, text=True,
                                 check=True).stdout
        entry.sass = opcodes(listing)
    return entries


def blocks_per_sm(e: Entry, threads: int, dynamic_smem: int = 0) -> int:
    """sm_90's occupancy for a kernel (what the driver's cuOccupancyMaxActiveBlocksPerMultiprocessor
    says): registers are allocated per warp in units of 256 from 64 K, shared memory (static and the
    launch's dynamic) from 228 KB with 1 KB reserved per block; at most 64 warps and 32 blocks."""
    warps = -(-threads // 32)
    by_regs = 65536 // (-(-e.registers * 32 // 256) * 256) // warps
    by_smem = 233472 // (e.smem + dynamic_smem + 1024)
    return min(by_regs, by_smem, 64 // warps, 32)


def plan_rows(entries: dict[str, Entry], sms: int) -> list[str]:
    """The kernels and grids the launch plan gives each case (bf16) on a device of ``sms``
    multiprocessors (the prefill split-K fills one wave of the shrink, from its occupancy, capped as
    plan_call caps it)."""
    rows = ["| case | shrink | grid (split-K x items) | expand | grid (tiles x items) |", "| --- | --- | --- | --- | --- |"]
    for name, rows_, segments, rank, mode in CASES:
        problem = Problem(rows_, 4096, (4096,), segments, rank)
        prefill = not _plan.is_decode(rows_, mode, segments if mode == 0 else rows_, rank)
        pdl = not prefill and rank <= _launch.SHRINK_DEC_RC  # sm_90: the expand follows early (expand_follows_early)
        kind, variant = _launch.shrink_kernel(prefill, rank, pdl)
        shrink = f"lora_{kind}_bf16_{variant}"
        threads = 32 * _launch.prefill_shrink_tiles(rank).warps if prefill else _launch.THREADS
        per_sm = min(blocks_per_sm(entries[shrink], threads, dynamic_smem_bytes(shrink)),
                     _launch.PREFILL_MAX_BLOCKS_PER_SM)  # as plan_call caps it
        wave = per_sm * sms
        plan = _plan.make_plan(problem, mode, segments if mode == 0 else rows_, wave)
        if plan.decode:
            tiles, _ = _launch._slice_args(plan, problem, _launch.DEC_COLS)
            expand = "lora_expand_dec_bf16_m4"
        else:  # groups of walk tiles, walk for one wave of the kernel's blocks
            expand = f"lora_expand_bf16_m{plan.bm}"
            per_sm = blocks_per_sm(entries[expand], _launch.EXPAND_THREADS, walk_smem_bytes(rank))
            walk = _plan.walk_count(problem.widths, rows_, plan.bm, per_sm * sms)
            tiles, _ = _launch._slice_args(plan, problem, WALK_BN * walk)
            expand += f" ({walk} tiles a block)"
        rows.append(f"| {name} | {shrink} | {plan.ksplit} x {plan.items} | {expand} | {tiles} x {plan.items} |")
    return rows


def find_cuobjdump(given: str | None) -> str:
    if given:
        return given
    if found := shutil.which("cuobjdump"):
        return found
    spec = importlib.util.find_spec("nvidia")
    for folder in spec.submodule_search_locations if spec else ():
        for candidate in Path(folder).glob("cu*/bin/cuobjdump"):
            return str(candidate)
    raise SystemExit("cuobjdump not found: pip install nvidia-cuda-cuobjdump, or pass --cuobjdump PATH")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--cuobjdump", default=None)
    ap.add_argument("--sms", type=int, default=132, help="multiprocessors of the device (H200: 132)")
    args = ap.parse_args()
    cuobjdump = find_cuobjdump(args.cuobjdump)
    with tempfile.TemporaryDirectory() as tmp:
        entries = {name: e for source in SOURCES
                   for name, e in compile_source(source, args.arch, cuobjdump, Path(tmp)).items() if "bf16" in name}
    print("\n".join(plan_rows(entries, args.sms)), "\n")
    print("| kernel | registers | spill bytes | static smem | dynamic smem | blocks/SM | SASS instructions | "
          + " | ".join(OPCODES) + " |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in OPCODES) + " |")
    for name, e in sorted(entries.items()):
        counts, dyn = mix(e.sass), dynamic_smem_bytes(name)
        nc = re.fullmatch(r"lora_shrink_bf16_m128_r(\d+)", name)
        threads = (32 * PREFILL_SHRINK_TILES[int(nc[1])].warps if nc
                   else _launch.EXPAND_THREADS if name == "lora_expand_bf16_m128" else _launch.THREADS)
        print(f"| {name} | {e.registers} | {e.spill_bytes} | {e.smem} | {dyn} | {blocks_per_sm(e, threads, dyn)} | "
              f"{len(e.sass)} | " + " | ".join(str(counts[o]) for o in OPCODES) + " |")


if __name__ == "__main__":
    main()
