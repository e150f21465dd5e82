"""Compile and run a small C program against cuda.h (where the CUDA toolkit is present)."""

from __future__ import annotations

import glob
import os
import subprocess


def _cuda_include() -> str | None:
    roots = [os.environ.get("CUDA_HOME", ""), "/usr/local/cuda", *sorted(glob.glob("/usr/local/cuda-*"))]
    return next((f"{r}/include" for r in roots if r and os.path.exists(f"{r}/include/cuda.h")), None)


def c_probe(source: str, tmp_path) -> list[int]:
    """The integers a C program printed, built with gcc against cuda.h."""
    src, exe = tmp_path / "probe.c", tmp_path / "probe"
    src.write_text(source)
    subprocess.run(["gcc", f"-I{_cuda_include()}", str(src), "-o", str(exe)], check=True, timeout=120)
    return [int(v) for v in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.split()]
