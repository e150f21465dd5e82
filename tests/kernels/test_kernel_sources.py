"""Every CUDA source under kernels/csrc compiles for sm_90 (nvcc -ptx), and the sources with
Hopper-only paths for sm_90a too, so CI catches compile errors without a GPU. Skipped only where
nvcc is not on PATH."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from loraplex.kernels.cuda._nvrtc import ARCH_SPECIFIC_SOURCES

CSRC = Path(__file__).resolve().parents[2] / "kernels" / "csrc"
SOURCES = sorted(CSRC.glob("*.cu"))


def test_sources_exist():
    names = {p.name for p in SOURCES}
    assert set(KERNELS) <= names


KERNELS = {  # the extern "C" entry points kernels/cuda launches, per source
    "lora_shrink.cu": [f"lora_shrink_{t}_m128_r{r}" for t in ("bf16", "fp16") for r in (32, 64, 128)],
    "lora_shrink_dec.cu": [f"lora_shrink_dec_{t}_m4{p}" for t in ("bf16", "fp16") for p in ("", "_pdl")],
    "lora_expand.cu": [f"lora_expand_{t}_m128" for t in ("bf16", "fp16")],
    "lora_expand_dec.cu": [f"lora_expand_dec_{t}_m4" for t in ("bf16", "fp16")],
}


def _ptx(source: Path, arch: str, out: Path) -> str:
    proc = subprocess.run(
        ["nvcc", "-ptx", f"-arch={arch}", "-std=c++17", "-DPD_INSTANTIATE_FOR_TEST", f"-I{CSRC}", str(source),
         "-o", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return out.read_text()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_compiles_for_sm90(source, tmp_path):
    ptx = _ptx(source, "sm_90", tmp_path / (source.stem + ".ptx"))
    for name in KERNELS.get(source.name, []):
        assert f".entry {name}(" in ptx
    if source.name == "paged_decode.cu":  # templates: the test instantiations (mangled names)
        assert ptx.count(".entry _Z12paged_decode") == 4 and ".entry _Z20paged_decode_combine" in ptx  # + head_dim 256
    if source.name == "fused_ops.cu":
        assert all(f"{n}I" in ptx for n in ("12add_rms_norm", "10rope_cache", "8silu_mul"))
    if source.name in ("lora_shrink.cu", "lora_expand.cu"):
        assert "mma.sync.aligned.m16n8k16" in ptx  # the tensor-core path is really there
    assert "wgmma" not in ptx  # (sm_90a only: a plain sm_90 build must not need it)
    if source.name == "lora_shrink_dec.cu":
        assert "shfl.sync.bfly" in ptx  # the CUDA-core rows' butterfly reduction
    if source.name == "lora_expand_dec.cu":
        assert "cp.async.cg.shared.global" in ptx  # B lands in shared memory, not registers



@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("name", sorted(ARCH_SPECIFIC_SOURCES))
def test_arch_specific_sources_compile_for_sm90a_with_their_wgmma(name, tmp_path):
    """What the runtime compiles for sm_90a on an H100/H200 (kernels/cuda/_nvrtc.py): the prefill
    shrink's rank-128 variant multiplies by warpgroup products (n64 and n128), keeping mma.sync
    for the stages that x's tensor map does not serve; the prefill expand takes m64n64 products
    for ranks above 32 and keeps mma.sync for the others."""
    ptx = _ptx(CSRC / name, "sm_90a", tmp_path / "k.ptx")
    for name_ in KERNELS[name]:
        assert f".entry {name_}(" in ptx
    entry, widths = {"lora_shrink.cu": ("lora_shrink_bf16_m128_r128", (64, 128)),
                     "lora_expand.cu": ("lora_expand_bf16_m128", (64,))}[name]
    body = ptx.split(f".entry {entry}(")[1].split(".entry ")[0]
    for n in widths:
        assert f"wgmma.mma_async.sync.aligned.m64n{n}k16.f32.bf16.bf16" in body
    assert "mma.sync.aligned.m16n8k16" in body
