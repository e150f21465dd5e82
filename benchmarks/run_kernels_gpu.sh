#!/usr/bin/env bash
# On the GPU machine: kernel tests, then the kernel benchmark; logs into $OUT (or ./.out).
# Usage: bash benchmarks/run_kernels_gpu.sh [--quick]
set -o pipefail
OUT=${OUT:-.out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
timeout 300 python3 -m pytest -q -x --noconftest -p no:cacheprovider tests/gpu/test_kernels.py 2>&1 | tee "$OUT/pytest.log"
timeout 420 python3 benchmarks/bench_kernels.py "$@" --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
