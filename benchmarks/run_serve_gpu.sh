#!/usr/bin/env bash
# On the GPU machine: bench_open_loop.py with the given arguments, after installing the server's
# Python packages the machine's image lacks from carried wheels (.whl: grpcio's health and
# reflection services, starlette, uvicorn, pydantic, gguf, redis, boto3) and with the generated
# gRPC code (loraplex/, from `make protos`; grpcio-tools 1.84.0 makes it, so the image's grpcio
# 1.84.0 runs it) carried too. Log into $OUT (or ./.out).
# Usage: bash benchmarks/run_serve_gpu.sh --model llama-7b --device cuda --dtype bfloat16 ...
set -o pipefail
source benchmarks/gpu_env.sh || exit 1
[ -f loraplex/v1/inference_pb2.py ] || { echo "loraplex/ (the generated gRPC code) was not carried" >&2; exit 1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -m benchmarks.serving.bench_open_loop --workdir /tmp "$@" 2>&1 | tee "$OUT/bench_open_loop.log"
