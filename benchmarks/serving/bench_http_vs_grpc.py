"""HTTP (OpenAI SSE) streaming overhead per token against gRPC, on the same engine.

One ``loraplex-server`` process (a dummy model on the CPU by default, ``--model-format dummy
--model tiny``) serves both ports; this process runs 1, 16 and 128 concurrent greedy streams of
``--tokens`` tokens each, first over gRPC (AsyncLoraplexClient), then over HTTP (a minimal
asyncio SSE reader, so the client's own parsing costs about what the gRPC client's does), and
reports wall time per streamed token for each and the difference: what the HTTP edge adds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from benchmarks import ROOT

from benchmarks.common.results import record_results

from loraplex.clients import AsyncLoraplexClient, LoraplexClient


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, fmt: str, max_seqs: int, workdir: Path) -> tuple[subprocess.Popen, int, int]:
    grpc_port, http_port = _free_port(), _free_port()
    args = [sys.executable, "-P", "-m", "loraplex.inference_server.main", "--model", model, "--model-format", fmt,
            "--device", "cpu",
            "--port", str(grpc_port), "--http-port", str(http_port), "--metrics-port", "0",
            "--max-num-seqs", str(max_seqs), "--num-kv-blocks", "4096", "--max-waiting", "1024",
            "--adapter-dir", str(workdir / "adapters"), "--log-level", "WARNING"]
    log = open(workdir / "server.log", "w")  # noqa: SIM115  (closed with the process)
    proc = subprocess.Popen(args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    with LoraplexClient(f"127.0.0.1:{grpc_port}", timeout=5) as client:
        deadline = time.monotonic() + 300
        while client.health() != "SERVING":
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError((workdir / "server.log").read_text()[-2000:])
            time.sleep(0.2)
    return proc, grpc_port, http_port


async def grpc_streams(port: int, n: int, tokens: int) -> int:
    async with AsyncLoraplexClient(f"127.0.0.1:{port}", timeout=600) as client:
        async def one(i: int) -> int:
            count = 0
            async for event in client.generate(prompt=f"story {i}", max_new_tokens=tokens, ignore_eos=True):
                count += len(event.token_ids)
            return count
        return sum(await asyncio.gather(*(one(i) for i in range(n))))


async def _sse_stream(port: int, model: str, i: int, tokens: int) -> int:
    """One streamed completion over a raw connection; the number of data chunks before [DONE]."""
    body = json.dumps({"model": model, "prompt": f"story {i}", "max_tokens": tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    chunks = 0
    while True:
        line = await reader.readline()
        if not line or line.startswith(b"data: [DONE]"):
            break
        if line.startswith(b"data: {"):
            chunks += 1
    writer.close()
    return chunks


async def http_streams(port: int, model: str, n: int, tokens: int) -> int:
    return sum(await asyncio.gather(*(_sse_stream(port, model, i, tokens) for i in range(n))))


def _timed(run) -> tuple[float, int]:  # noqa: ANN001
    start = time.perf_counter()
    tokens = asyncio.run(run())
    return time.perf_counter() - start, tokens


def measure(grpc_port: int, http_port: int, model: str, n: int, tokens: int, repeats: int) -> dict[str, float]:
    """Median microseconds per streamed token over each edge (alternating runs)."""
    per_token: dict[str, list[float]] = {"grpc": [], "http": []}
    for _ in range(repeats):
        for edge, run in (("grpc", lambda: grpc_streams(grpc_port, n, tokens)),
                          ("http", lambda: http_streams(http_port, model, n, tokens))):
            seconds, streamed = _timed(run)
            if streamed != n * tokens:
                raise RuntimeError(f"{edge}: {streamed} tokens streamed, expected {n * tokens}")
            per_token[edge].append(seconds / streamed * 1e6)
    return {edge: statistics.median(v) for edge, v in per_token.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--model-format", default="dummy")
    ap.add_argument("--streams", default="1,16,128")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--results", type=Path, default=None,
                    help="record the run in this page (benchmarks/history/RESULTS-2026.md; RESULTS.md is at its length)")
    args = ap.parse_args()
    counts = [int(s) for s in args.streams.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        proc, grpc_port, http_port = start_server(args.model, args.model_format, max(counts), Path(tmp))
        try:
            model = json.loads(urllib.request.urlopen(
                f"http://127.0.0.1:{http_port}/v1/models", timeout=5).read())["data"][0]["id"]
            measure(grpc_port, http_port, model, 4, 8, 1)  # warm-up: connections, first steps
            rows = ["| streams | gRPC µs/token | HTTP µs/token | HTTP overhead µs/token |",
                    "| ---: | ---: | ---: | ---: |"]
            for n in counts:
                m = measure(grpc_port, http_port, model, n, args.tokens, args.repeats)
                rows.append(f"| {n} | {m['grpc']:.0f} | {m['http']:.0f} | {m['http'] - m['grpc']:+.0f} |")
                print(rows[-1], flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    print("\n".join(rows))
    if args.results:
        notes = (f"{args.tokens} greedy tokens per stream, model {args.model} ({args.model_format}) on the CPU, "
                 f"{os.cpu_count()} cores; client and server on one machine; wall time per streamed token, median "
                 f"of {args.repeats} runs per edge, alternating.")
        record_results(args.results, "HTTP (OpenAI SSE) streaming overhead against gRPC, CPU",
                       "python -m benchmarks.serving.bench_http_vs_grpc " + " ".join(sys.argv[1:]), rows, notes)


if __name__ == "__main__":
    main()
