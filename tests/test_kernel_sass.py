"""benchmarks/kernel_sass.py: ptxas's report and a SASS listing read right, and the launch plans
name kernels that exist (without a GPU; the ptxas part where nvcc is on PATH)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_kernel_sources import CSRC, KERNELS

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import kernel_sass  # noqa: E402

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


def test_plans_name_kernels_the_sources_define() -> None:
    rows = kernel_sass.plan_rows()[2:]
    assert len(rows) == len(kernel_sass.CASES)
    defined = {name for names in KERNELS.values() for name in names}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[1] in defined and cells[3] in defined, row
    assert "lora_expand_dec_bf16_m4" in rows[0] and "lora_expand_bf16_m64" in rows[-1]  # decode vs prefill


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
def test_ptxas_report_gives_every_entry_its_registers(tmp_path) -> None:
    proc = subprocess.run(["nvcc", "-cubin", "-arch=sm_90", "-std=c++17", "-Xptxas", "-v", f"-I{CSRC}",
                           str(CSRC / "lora_expand_dec.cu"), "-o", str(tmp_path / "k.cubin")],
                          capture_output=True, text=True, check=True)
    entries = kernel_sass.ptxas_entries(proc.stderr)
    assert set(entries) == set(KERNELS["lora_expand_dec.cu"])
    assert all(0 < e.registers <= 255 and e.smem > 0 and e.spill_bytes == 0 for e in entries.values())
