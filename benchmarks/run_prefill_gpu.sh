#!/usr/bin/env bash
# On the GPU machine: the kernel tests, then the prefill kernels' tunables swept (add_lora, shrink
# and expand alone), optionally after the same cases on another version's kernels, then the
# prefill rows of bench_add_lora. Logs into $OUT (or ./.out).
# Usage: [BASE=dir] bash benchmarks/run_prefill_gpu.sh [BLOCKS ...]
#   BASE: a folder with that version's loraplex/ and the folders it links (e.g. `git archive main loraplex
#   kernels | tar -x -C .gpu-assets/base`, carried with the tree), timed with this tree's script (its
#   loraplex comes first: PYTHONPATH precedes this checkout's root, which the benchmarks put last); BLOCKS as in
#   benchmarks/kernels/bench_prefill_tunables.py (default: 1 2).
set -o pipefail
OUT=${OUT:-.out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
timeout 240 python3 -m pytest -q -p no:cacheprovider --tb=short --maxfail=4 tests/gpu/test_kernels.py 2>&1 \
  | tail -25 | tee "$OUT/pytest.log"
if [ -n "$BASE" ]; then
  PYTHONPATH="$BASE" timeout 150 python3 -m benchmarks.kernels.bench_prefill_tunables 2>&1 | sed 's/^/base: /' \
    | tee "$OUT/base.log"
fi
[ $# -eq 0 ] && set -- 1 2
timeout 300 python3 -m benchmarks.kernels.bench_prefill_tunables "$@" 2>&1 | tee "$OUT/tunables.log"
timeout 200 python3 -m benchmarks.kernels.bench_add_lora --prefill-only --quick --out "$OUT/bench.json" 2>&1 | tail -20 \
  | tee "$OUT/bench.log"
