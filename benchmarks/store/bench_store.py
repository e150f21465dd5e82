"""Adapter store throughput: upload and fetch of one large adapter (default ~80 MB).

Runs real ``loraplex-store`` processes and talks to them over gRPC on loopback with
StoreClient, as the inference server would:

- local dir:  local directory blobs, in-memory index, no cache (every fetch reads disk);
- Redis hit:  S3 blobs (moto server) + Redis index and cache (fetches come from Redis);
- S3 miss:    S3 blobs + Redis index, cache off (every fetch reads S3);
- Redis hit, direct: as Redis hit, but the client reads the cached blob from Redis itself
  (StoreClient(cache=...)): one Stat through the store, no blob copy through it.

Every fetch checks the sha256 of each file in the store and again in the client.
Needs redis-server on PATH and moto[server] installed. S3 here is moto (a Python HTTP
server), so the S3 numbers are a floor, not what AWS S3 would give.

Usage: python -m benchmarks.store.bench_store [--size-mb 80] [--repeats 5] [--results benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save

from benchmarks import ROOT as REPO

from loraplex.adapter_store.backends.redis_cache import RedisBlobCache
from loraplex.adapter_store.backends.redis_conn import connect
from loraplex.adapter_store.client import StoreClient
from loraplex.adapter_store.settings import RedisSettings
from benchmarks.common.results import record_results

# Llama-2-7B projection shapes (in, out); rank 16 on all 7 in 32 layers is ~80 MB in bf16.
SHAPES = {"q_proj": (4096, 4096), "k_proj": (4096, 4096), "v_proj": (4096, 4096), "o_proj": (4096, 4096),
          "gate_proj": (4096, 11008), "up_proj": (4096, 11008), "down_proj": (11008, 4096)}
AWS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench", "AWS_DEFAULT_REGION": "us-east-1"}


def make_adapter(size_mb: float) -> dict[str, bytes]:
    """A PEFT LoRA adapter on Llama-7B shapes, bf16 (raw uint16 bits), with as many layers as fit."""
    rank = 16
    per_layer = sum(rank * (i + o) * 2 for i, o in SHAPES.values())
    layers = max(1, round(size_mb * 1e6 / per_layer))
    rng = np.random.default_rng(0)
    tensors = {}
    for layer in range(layers):
        for module, (fan_in, fan_out) in SHAPES.items():
            parent = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            stem = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            tensors[f"{stem}.lora_A.weight"] = rng.integers(0, 2**16, (rank, fan_in), dtype=np.uint16)
            tensors[f"{stem}.lora_B.weight"] = rng.integers(0, 2**16, (fan_out, rank), dtype=np.uint16)
    weights = _as_bf16(bytearray(save(tensors)))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 32, "target_modules": list(SHAPES), "bias": "none"}
    return {"adapter_config.json": json.dumps(config).encode(), "adapter_model.safetensors": weights}


def _as_bf16(blob: bytearray) -> bytes:
    """numpy has no bf16: write the tensors as U16 and relabel them BF16 (same element size)."""
    n = int.from_bytes(blob[:8], "little")
    header = blob[8 : 8 + n].decode().replace('"U16"', '"BF16"').encode()
    header = header.ljust(-(-len(header) // 8) * 8, b" ")  # data offsets are relative: only the length moves
    return len(header).to_bytes(8, "little") + header + bytes(blob[8 + n :])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on port {port}")


def start(cmd: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=f, text=True, env={**os.environ, **env})


def start_store(args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-P", "-m", "loraplex.adapter_store.main", "--listen", "127.0.0.1:0", "--log-level", "WARNING",
           *args]
    proc = start(cmd, {**AWS, "PYTHONPATH": str(REPO)}, log)
    line = proc.stdout.readline()
    if "listening on port" not in line:
        raise RuntimeError(f"store did not start: {log.read_text()[-2000:]}")
    return proc, f"127.0.0.1:{line.rsplit(' ', 1)[1].strip()}"


def timed(fn, repeats: int) -> list[float]:  # noqa: ANN001
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def bench_case(name: str, target: str, files: dict[str, bytes], repeats: int, cache=None) -> dict[str, float]:  # noqa: ANN001
    size = sum(len(v) for v in files.values())
    with StoreClient(target, timeout_s=300, cache=cache) as client:
        up = timed(lambda: client.put("bench/big", files), repeats)
        client.fetch("bench/big")  # warm (the Redis cache is filled on upload already)
        down = timed(lambda: client.fetch("bench/big"), repeats)
    mb = size / 1e6
    row = {"case": name, "size_mb": mb, "upload_s": statistics.median(up), "fetch_s": statistics.median(down)}
    row["upload_mb_s"], row["fetch_mb_s"] = mb / row["upload_s"], mb / row["fetch_s"]
    return row


def report(rows: list[dict[str, float]], repeats: int) -> list[str]:
    lines = [f"adapter: {rows[0]['size_mb']:.1f} MB (bf16, rank 16, Llama-7B shapes); median of {repeats} runs",
             "", "| case | upload s | upload MB/s | fetch s | fetch MB/s |", "|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['upload_s']:.3f} | {r['upload_mb_s']:.0f} | {r['fetch_s']:.3f} | "
                     f"{r['fetch_mb_s']:.0f} |")
    return lines


def write_results(path: Path, table: list[str]) -> None:
    """This run's '## Adapter store ...' section (date, commit, machine, command, the table) into
    the page at ``path``, in place of the previous run's."""
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else "?"
    host = (f"{cpu}, {os.cpu_count()} cores (no GPU); 1-minute load average at the end: "
            f"{os.getloadavg()[0]:.1f} (other jobs share this machine: timings vary run to run)")
    record_results(path, "Adapter store: upload and fetch of an 80 MB adapter",
                   f"python -m benchmarks.store.bench_store {' '.join(sys.argv[1:])}", table, machine_name=host)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=80.0)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--results", type=Path,
                        help="write this run's section into this markdown file, in place of the last run's")
    args = parser.parse_args()
    redis_bin = shutil.which("redis-server")
    if redis_bin is None:
        print("redis-server is not installed (scripts/ci_services.sh)", file=sys.stderr)
        return 1
    files = make_adapter(args.size_mb)
    tmp = Path(tempfile.mkdtemp(prefix="bench-store-"))
    procs: list[subprocess.Popen] = []
    try:
        redis_port, s3_port = free_port(), free_port()
        procs.append(start([redis_bin, "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                            "--appendonly", "no"], {}, tmp / "redis.log"))
        procs.append(start([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(s3_port)], AWS,
                           tmp / "moto.log"))
        wait_port(redis_port)
        wait_port(s3_port)
        import boto3  # noqa: PLC0415

        boto3.client("s3", endpoint_url=f"http://127.0.0.1:{s3_port}", region_name="us-east-1",
                     aws_access_key_id="bench", aws_secret_access_key="bench").create_bucket(Bucket="bench")
        s3 = ["--s3-bucket", "bench", "--s3-endpoint-url", f"http://127.0.0.1:{s3_port}", "--s3-region", "us-east-1",
              "--redis-url", f"redis://127.0.0.1:{redis_port}/0"]
        cases = [
            ("local dir", ["--local-dir", str(tmp / "local"), "--cache-mib", "0"]),
            ("Redis hit", [*s3, "--redis-namespace", "hit", "--cache-mib", "512"]),
            ("S3 miss", [*s3, "--redis-namespace", "miss", "--cache-mib", "0"]),
        ]
        rows = []
        for name, store_args in cases:
            proc, target = start_store(store_args, tmp / f"store-{name.replace(' ', '_')}.log")
            procs.append(proc)
            rows.append(bench_case(name, target, files, args.repeats))
            if name == "Redis hit":
                cache = RedisBlobCache(connect(RedisSettings(url=f"redis://127.0.0.1:{redis_port}/0")), "hit", 0)
                rows.append(bench_case("Redis hit, direct", target, files, args.repeats, cache=cache))
            proc.terminate()
            proc.wait(30)
        table = report(rows, args.repeats)
        print("\n".join(table))
        if args.results is not None:
            write_results(args.results, table)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                p.wait(30)
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
