"""benchmarks/store/bench_redis_read.py runs end to end against a real redis-server (a small blob),
so a broken script is found here and not on the device."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # starts redis-server
def test_bench_redis_read_prints_every_row(redis_url) -> None:
    out = subprocess.run([sys.executable, "-m", "benchmarks.store.bench_redis_read", "--redis-url", redis_url, "--mb", "2",
                          "--reps", "1"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    rows = re.findall(r"^\| (.+) \| ([\d.]+) \|$", out.stdout, re.M)
    names = [name for name, _ in rows]
    assert names[:2] == ["one GET", "sha256 of the bytes alone"]
    assert sum("ranged GETs" in n for n in names) == 4 and "the store's read" in names[-1]
    assert all(float(ms) > 0 for _, ms in rows)
