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
import statistics
import sys
import tempfile
import time
from pathlib import Path


from benchmarks.common.results import record_results
from benchmarks.common.server import start_server

from loraplex.clients import AsyncLoraplexClient


def server_flags(model: str, fmt: str, max_seqs: int, workdir: Path) -> list[str]:
    """loraplex-server's flags: the model on the CPU, room for ``max_seqs`` streams, no adapters."""
    return ["--model", model, "--model-format", fmt, "--device", "cpu", "--max-num-seqs", str(max_seqs),
            "--num-kv-blocks", "4096", "--max-waiting", "1024", "--adapter-dir", str(workdir / "adapters"),
            "--log-level", "WARNING"]


async def grpc_streams(address: str, n: int, tokens: int) -> int:
    async with AsyncLoraplexClient(address, timeout=600) as client:
        async def one(i: int) -> int:
            count = 0
            async for event in client.generate(prompt=f"story {i}", max_new_tokens=tokens, ignore_eos=True):
                count += len(event.token_ids)
            return count
        return sum(await asyncio.gather(*(one(i) for i in range(n))))


async def _sse_stream(port: int, model: str, i: int, tokens: int) -> int:
    """One streamed completion over a raw connection; its tokens, as its usage chunk counts them
    (a chunk may carry several tokens when the stream's reader fell behind)."""
    body = json.dumps({"model": model, "prompt": f"story {i}", "max_tokens": tokens, "temperature": 0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    streamed = 0
    while True:
        line = await reader.readline()
        if not line or line.startswith(b"data: [DONE]"):
            break
        if line.startswith(b"data: {"):
            usage = json.loads(line[len(b"data: "):]).get("usage")
            streamed = usage["completion_tokens"] if usage else streamed
    writer.close()
    return streamed


async def http_streams(port: int, model: str, n: int, tokens: int) -> int:
    return sum(await asyncio.gather(*(_sse_stream(port, model, i, tokens) for i in range(n))))


def _timed(run) -> tuple[float, int]:  # noqa: ANN001
    start = time.perf_counter()
    tokens = asyncio.run(run())
    return time.perf_counter() - start, tokens


def measure(grpc_address: str, http_port: int, model: str, n: int, tokens: int, repeats: int) -> dict[str, float]:
    """Median microseconds per streamed token over each edge (alternating runs)."""
    per_token: dict[str, list[float]] = {"grpc": [], "http": []}
    for _ in range(repeats):
        for edge, run in (("grpc", lambda: grpc_streams(grpc_address, n, tokens)),
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
                    help="write this run's section into this page, in place of the one of its title "
                         "(benchmarks/RESULTS.md; benchmarks/history/ is closed)")
    args = ap.parse_args()
    counts = [int(s) for s in args.streams.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(server_flags(args.model, args.model_format, max(counts), Path(tmp)),
                              Path(tmp) / "server.log", timeout=300)
        try:
            address, http_port, model = server.grpc_address, server.http_port, server.base_model
            measure(address, http_port, model, 4, 8, 1)  # warm-up: connections, first steps
            rows = ["| streams | gRPC µs/token | HTTP µs/token | HTTP overhead µs/token |",
                    "| ---: | ---: | ---: | ---: |"]
            for n in counts:
                m = measure(address, http_port, model, n, args.tokens, args.repeats)
                rows.append(f"| {n} | {m['grpc']:.0f} | {m['http']:.0f} | {m['http'] - m['grpc']:+.0f} |")
                print(rows[-1], flush=True)
        finally:
            server.stop()
    print("\n".join(rows))
    if args.results:
        notes = (f"{args.tokens} greedy tokens per stream, model {args.model} ({args.model_format}) on the CPU, "
                 f"{os.cpu_count()} cores; client and server on one machine; wall time per streamed token, median "
                 f"of {args.repeats} runs per edge, alternating.")
        record_results(args.results, "HTTP (OpenAI SSE) streaming overhead against gRPC, CPU",
                       "python -m benchmarks.serving.bench_http_vs_grpc " + " ".join(sys.argv[1:]), rows, notes)


if __name__ == "__main__":
    main()
