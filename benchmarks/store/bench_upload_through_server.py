"""How much memory the inference server holds while an adapter upload passes through it to the store.

A real ``loraplex-store`` (local blobs) and a real ``loraplex-server`` on the embedded SmolLM2-135M
(CPU) with ``--adapter-store``; the Python client uploads a PEFT folder of ~80 MB (SmolLM2's
shapes, rank 64, float32, all 7 projections: an adapter that fits the served base, which the
store checks) through the server's UploadAdapter. A thread samples the server's resident memory
(VmRSS in /proc/<pid>/status) every 2 ms during each upload; reported, as medians over
``--repeats`` uploads: the server's RSS before, its peak growth during the upload, and the
upload's time and MB/s (client to stored, end to end).

Usage: python -m benchmarks.store.bench_upload_through_server [--repeats 3] [--results benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

from benchmarks.common.results import record_results
from benchmarks.common.server import start_server
from benchmarks.store.bench_store import start_store

# SmolLM2-135M (the embedded default): hidden 576, MLP 1536, 3 KV heads of 64; (in, out) per projection.
SHAPES = {"q_proj": (576, 576), "k_proj": (576, 192), "v_proj": (576, 192), "o_proj": (576, 576),
          "gate_proj": (576, 1536), "up_proj": (576, 1536), "down_proj": (1536, 576)}
LAYERS, RANK = 30, 64
SAMPLE_S = 0.002
TITLE = "Adapter upload through the inference server: its memory while 78 MB pass (SmolLM2 base, CPU)"


def write_adapter(folder: Path) -> int:
    """A PEFT LoRA folder for the base above; its size in bytes."""
    rng = np.random.default_rng(0)
    tensors = {}
    for layer in range(LAYERS):
        for module, (fan_in, fan_out) in SHAPES.items():
            parent = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            stem = f"base_model.model.model.layers.{layer}.{parent}.{module}"
            tensors[f"{stem}.lora_A.weight"] = rng.standard_normal((RANK, fan_in), dtype=np.float32) * 0.01
            tensors[f"{stem}.lora_B.weight"] = rng.standard_normal((fan_out, RANK), dtype=np.float32) * 0.01
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": RANK, "lora_alpha": RANK, "target_modules": list(SHAPES), "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return sum(f.stat().st_size for f in folder.iterdir())


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


class PeakSampler:
    """The largest RSS of ``pid`` seen while the ``with`` block runs."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak = pid, 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._done.is_set():
            self.peak = max(self.peak, rss_bytes(self.pid))
            time.sleep(SAMPLE_S)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes(self.pid))


def measure(address: str, pid: int, folder: Path, repeats: int) -> list[dict[str, float]]:
    from loraplex.clients import LoraplexClient

    rows = []
    with LoraplexClient(address, timeout=300) as client:
        for i in range(repeats):
            before = rss_bytes(pid)
            started = time.perf_counter()
            with PeakSampler(pid) as sampler:
                client.upload_adapter(f"bench/through-{i}", folder)
            rows.append({"before": before, "growth": sampler.peak - before, "s": time.perf_counter() - started})
    return rows


def report(size: int, rows: list[dict[str, float]]) -> list[str]:
    mib = 1 << 20
    median = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    growths = ", ".join(f"{r['growth'] / mib:.0f}" for r in rows)
    return [f"| server (SmolLM2 shapes, rank {RANK}, float32) | RSS before | peak growth, median (each upload) | "
            "upload s | MB/s |", "|---|---|---|---|---|",
            f"| this commit | {median['before'] / mib:.0f} MiB | {median['growth'] / mib:.0f} MiB ({growths}) | "
            f"{median['s']:.2f} | {size / 1e6 / median['s']:.0f} |"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--results", type=Path,
                        help="write this run's section into this markdown file, in place of the last run's")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="bench-upload-"))
    size = write_adapter(tmp / "adapter")
    print(f"adapter: {size / 1e6:.1f} MB; RSS sampled every {SAMPLE_S * 1e3:g} ms")
    store, target = start_store(["--local-dir", str(tmp / "blobs"), "--metrics-port", "0"], tmp / "store.log")
    server = None
    try:
        server = start_server(["--adapter-store", target, "--device", "cpu"], tmp / "server.log", http=False)
        table = report(size, measure(server.grpc_address, server.proc.pid, tmp / "adapter", args.repeats))
        print("\n".join(table))
        if args.results is not None:
            record_results(args.results, TITLE,
                           f"python -m benchmarks.store.bench_upload_through_server {' '.join(sys.argv[1:])}", table)
    finally:
        if server is not None:
            server.stop()
        store.terminate()
        store.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
