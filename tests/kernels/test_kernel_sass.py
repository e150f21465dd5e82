"""benchmarks/kernels/kernel_sass.py: ptxas's report and a SASS listing read right, the launch plans
name kernels that exist, and no LoRA kernel spills registers on sm_90 (without a GPU; the
ptxas part where nvcc is on PATH)."""

from __future__ import annotations

import shutil

import pytest

from benchmarks.kernels import kernel_sass
from loraplex.kernels.cuda._nvrtc import ARCH_SPECIFIC_SOURCES
from test_kernel_sources import KERNELS

LISTING = """
        Function : lora_expand_dec_bf16_m4
        /*0000*/                   LDC R1, c[0x0][0x28] ;                  /* 0x00000a00ff017b82 */
        /*0010*/              @!P0 LDS.U16 R77, [R74+0x4400] ;             /* 0x000fe20000000800 */
        /*0020*/                   HMMA.16816.F32.BF16 R64, R68, R78, R64 ; /* 0x000fe200078e00ff */
        /*0030*/                   LDGSTS.E.BYPASS.128 [R9], desc[UR16][R12.64] ;
        /*0040*/                   EXIT ;
"""


def test_opcodes_and_their_families() -> None:
    ops = kernel_sass.opcodes(LISTING)
    assert ops == ("LDC", "LDS.U16", "HMMA.16816.F32.BF16", "LDGSTS.E.BYPASS.128", "EXIT")
    counts = kernel_sass.mix(ops)
    assert (counts["LDS"], counts["LDS.U16"], counts["HMMA"], counts["LDGSTS"], counts["LDG"]) == (1, 1, 1, 1, 0)


@pytest.mark.parametrize(("registers", "smem", "blocks"), [(158, 34848, 3), (117, 34848, 4), (80, 34844, 6),
                                                         (127, 1052, 4), (32, 0, 16), (255, 0, 2), (64, 120000, 1)])
def test_sm90_occupancy_from_registers_and_shared_memory(registers, smem, blocks) -> None:
    """128-thread blocks: registers by the warp in units of 256 of 64 K, 228 KB of shared memory
    less 1 KB a block, 64 warps an SM (the first four as the H200's driver counts them)."""
    assert kernel_sass.blocks_per_sm(kernel_sass.Entry(registers=registers, smem=smem), 128) == blocks


def test_plans_name_kernels_the_sources_define() -> None:
    defined = {name for names in KERNELS.values() for name in names}
    entries = {name: kernel_sass.Entry(registers=128, smem=34848) for name in defined}
    rows = kernel_sass.plan_rows(entries, 132)[2:]
    assert len(rows) == len(kernel_sass.CASES)
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] in defined and cells[3].split(" (")[0] in defined, row
    assert "lora_expand_dec_bf16_m4" in rows[0] and "lora_expand_bf16_m128 (" in rows[-1]  # decode vs prefill


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("source, arch", [(s, "sm_90") for s in sorted(KERNELS)]
                         + [(s, "sm_90a") for s in sorted(ARCH_SPECIFIC_SOURCES)], ids=str)
def test_lora_kernels_do_not_spill_registers_on_sm90(source, arch, tmp_path) -> None:
    """Every entry the runtime launches is in ptxas's report, with its registers and shared
    memory, and none spills (a spill is local-memory traffic in the inner loop); for sm_90a too
    where the runtime compiles a source for it (the prefill shrink's wgmma)."""
    entries = kernel_sass.compile_cubin(source, arch, tmp_path / "k.cubin")
    assert set(KERNELS[source]) <= set(entries)
    assert all(0 < e.registers <= 255 and e.smem > 0 for e in entries.values()), entries
    assert {name: e.spill_bytes for name, e in entries.items() if e.spill_bytes} == {}


PTXAS = """
ptxas info    : Compiling entry function 'lora_shrink_bf16_m64_r32' for 'sm_90'
ptxas info    : Function properties for lora_shrink_bf16_m64_r32
    56 bytes stack frame, 8 bytes spill stores, 8 bytes spill loads
ptxas info    : Function properties for _Z15load_stage_edgeILi32ELi64ELi3EEvPtS0_
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 96 registers, used 1 barriers, 56 bytes cumulative stack size, 43044 bytes smem
ptxas info    : Compiling entry function 'lora_expand_bf16_m64' for 'sm_90'
ptxas info    : Function properties for lora_expand_bf16_m64
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 72 registers, used 1 barriers, 28704 bytes smem
"""


def test_ptxas_report_gives_each_entry_its_own_spills() -> None:
    """An entry's spills are read off its own properties line, not the device function it calls
    (whose line comes after it and reads 0)."""
    entries = kernel_sass.ptxas_entries(PTXAS)
    assert entries["lora_shrink_bf16_m64_r32"] == kernel_sass.Entry(registers=96, smem=43044, spill_bytes=16)
    assert entries["lora_expand_bf16_m64"] == kernel_sass.Entry(registers=72, smem=28704, spill_bytes=0)
