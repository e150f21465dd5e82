#!/usr/bin/env bash
# On the GPU machine: kernel tests, optionally Nsight Compute, then the
# kernel benchmark; logs into $OUT (or ./.out).
# Usage: bash benchmarks/run_kernels_gpu.sh [--ncu] [bench_add_lora.py args...]
set -o pipefail
OUT=${OUT:-.out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
timeout 240 python3 -m pytest -q -x --noconftest -p no:cacheprovider tests/gpu/test_kernels.py 2>&1 | tail -5 | tee "$OUT/pytest.log"
if [ "$1" = "--ncu" ]; then
  shift
  M=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active
  for s in no_instruction long_scoreboard barrier short_scoreboard wait math_pipe_throttle mio_throttle lg_throttle; do
    M=$M,smsp__average_warps_issue_stalled_${s}_per_issue_active.ratio
  done
  timeout 240 ncu --clock-control none -k regex:lora_ --launch-skip 6 --metrics "$M" \
    python3 -m benchmarks.kernels.profile_add_lora > "$OUT/ncu.txt" 2>&1
  grep -E "lora_|duration|throughput|warps_active|stalled" "$OUT/ncu.txt" | sed -E 's/ +/ /g' | cut -c1-150
fi
timeout 420 python3 -m benchmarks.kernels.bench_add_lora "$@" --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
