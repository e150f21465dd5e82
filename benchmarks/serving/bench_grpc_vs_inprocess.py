"""Serving-edge benchmark: streamed tokens/s and per-token latency through gRPC vs the in-process engine.

The same engine configuration runs twice: in this process (``engine.generate`` consumed
directly) and as a ``loraplex-server`` process reached over loopback gRPC by client worker
processes (raw generated stubs, so the client library's own cost is not counted). Each
round opens N concurrent greedy streams (N = 1, 16, 128), every stream with its own
adapter id cycling over a few adapters (plus the base model), and records the arrival time
of every token. Reported: aggregate tokens/s, inter-token latency p50/p99, time to first
token p50; the p50 difference is the edge's cost per token (PERF.md: <= 0.5 ms, and
>= 20k tokens/s to many clients). A tiny dummy model makes the engine fast enough that
the edge, not the model, is what is measured.

    python -m benchmarks.serving.bench_grpc_vs_inprocess [--device cuda] [--model tiny] \
        [--results benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path


from benchmarks.serving.adapter_folders import adapter_names, write_adapters
from benchmarks.common.server import SERVER, SYNTHETIC_SERVER, Server, server_with_switch_interval
from benchmarks.common.server import start_server as launch

PROMPT = list(range(10, 42))  # 32 prompt tokens


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def delivery_ms(streams: list[list[tuple]]) -> list[float]:
    """Synthetic engine: per token, its message's arrival time minus the step time stamped in
    its text (a message of several tokens carries their stamps, space-separated)."""
    out = []
    for _, *arrivals in streams:
        for t, _, text in arrivals:
            try:
                out.extend(1e3 * (t - float(stamp)) for stamp in text.split())
            except ValueError:
                return []  # real text: the real engine stamps nothing
    return out


def summarize(streams: list[list[tuple]], finishes: list[str]) -> dict[str, float]:
    """streams: per stream, (send time, 0, "") then (arrival time, tokens, text) per message;
    finishes: each stream's finish reason (anything but 'length' is a failed run)."""
    bad = sorted(set(finishes) - {"length"})
    if bad:
        raise RuntimeError(f"{sum(f != 'length' for f in finishes)} of {len(finishes)} streams ended with {bad}")
    gaps, ttfts, tokens = [], [], 0
    start, end = min(s[0][0] for s in streams), max(s[-1][0] for s in streams)
    for sent, *arrivals in streams:
        if not arrivals:
            continue
        ttfts.append(arrivals[0][0] - sent[0])
        for (t0, _, _), (t1, n, _) in zip(arrivals, arrivals[1:]):
            gaps.extend([(t1 - t0) / n] * n if n else [])
        tokens += sum(n for _, n, _ in arrivals)
    delivery = delivery_ms(streams)
    return {"delivery_p50_ms": percentile(delivery, 0.5), "delivery_p99_ms": percentile(delivery, 0.99),"tokens": tokens, "tok_s": tokens / max(end - start, 1e-9), "itl_p50_ms": 1e3 * percentile(gaps, 0.5),
            "itl_p99_ms": 1e3 * percentile(gaps, 0.99), "ttft_p50_ms": 1e3 * percentile(ttfts, 0.5)}


def adapter_for(i: int, adapters: list[str]) -> str | None:
    """Stream i's adapter: cycling over the adapters and the base model (None)."""
    pool = [None, *adapters]
    return pool[i % len(pool)]


# ---------------------------------------------------------------- in-process engine

def engine_config(args: argparse.Namespace):
    from loraplex.inference_server.engine.config import EngineConfig

    return EngineConfig(device=args.device, dtype=args.dtype, max_num_seqs=128, max_num_batched_tokens=4096,
                        num_kv_blocks=args.kv_blocks, block_size=16, max_waiting=1024)


def build_engine(args: argparse.Namespace, adapter_dir: Path):
    """The engine under test: the real one on a dummy model, or the model-free synthetic one."""
    if args.engine == "synthetic":
        from benchmarks.serving.synthetic_engine import SyntheticEngine

        return SyntheticEngine(args.step_ms / 1000)
    from loraplex.inference_server import build
    from loraplex.inference_server.engine.async_engine import AsyncEngine
    from loraplex.inference_server.model.checkpoint import ModelSource

    source = ModelSource(format="dummy", dummy=args.model, seed=0)
    return build.build_engine(AsyncEngine, engine_config(args), source, str(adapter_dir), False)


async def run_in_process(args: argparse.Namespace, adapter_dir: Path, adapters: list[str]) -> dict[int, dict]:
    from loraplex.inference_server.engine.request import GenerationRequest, SamplingParams, StoppingCriteria

    engine = await asyncio.to_thread(build_engine, args, adapter_dir)
    await engine.start()
    results = {}
    try:
        for n in [1, *args.streams]:  # the first round warms up
            async def one(i: int, tag: str) -> list[tuple[float, int]]:
                req = GenerationRequest(f"{tag}-{i}", tuple(PROMPT), adapter_for(i, adapters), SamplingParams(),
                                        StoppingCriteria(max_new_tokens=args.new_tokens, ignore_eos=True))
                sent, events = (time.perf_counter(), 0, ""), []
                async for e in engine.generate(req):
                    events.append((time.perf_counter(), len(e.token_ids), e.text))
                    finishes.append(e.finish_reason.value if e.finish_reason else None)
                return [sent, *events]
            finishes: list = []
            streams = await asyncio.gather(*(one(i, f"r{n}-{len(results)}") for i in range(n)))
            results[n] = summarize(streams, [f for f in finishes if f is not None])
    finally:
        await engine.shutdown()
    return results


# ---------------------------------------------------------------- over gRPC

def _client_worker(address: str, ids: list[int], adapters: list[str], new_tokens: int, start_at: float,
                   out: mp.Queue) -> None:
    """One client process: its share of the streams, started together at ``start_at``."""
    import grpc

    from loraplex.v1 import inference_pb2 as pb
    from loraplex.v1 import inference_pb2_grpc as pb_grpc

    async def main() -> tuple[list[list[tuple[float, int]]], list[str]]:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = pb_grpc.InferenceServiceStub(channel)

            async def one(i: int) -> list[tuple[float, int]]:
                req = pb.GenerateRequest(adapter_id=adapter_for(i, adapters) or "", token_ids=pb.TokenIds(ids=PROMPT),
                                         stopping=pb.StoppingCriteria(max_new_tokens=new_tokens, ignore_eos=True))
                sent, events = (time.perf_counter(), 0, ""), []
                async for m in stub.Generate(req):
                    events.append((time.perf_counter(), len(m.token_ids), m.text))
                    if m.finish_reason:
                        finishes.append(pb.FinishReason.Name(m.finish_reason).removeprefix("FINISH_REASON_").lower())
                return [sent, *events]
            finishes: list[str] = []
            await channel.channel_ready()
            await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
            return list(await asyncio.gather(*(one(i) for i in ids))), finishes

    out.put(asyncio.run(main()))


def run_rounds_over_grpc(args: argparse.Namespace, address: str, adapters: list[str]) -> dict[int, dict]:
    ctx = mp.get_context("spawn")
    results = {}
    for n in [1, *args.streams]:
        procs_n = max(1, min(args.client_procs, n))
        queue: mp.Queue = ctx.Queue()
        start_at = time.perf_counter() + 5.0  # perf_counter is CLOCK_MONOTONIC: shared by processes on Linux
        shares = [list(range(p, n, procs_n)) for p in range(procs_n)]
        procs = [ctx.Process(target=_client_worker, args=(address, s, adapters, args.new_tokens, start_at, queue))
                 for s in shares]
        for p in procs:
            p.start()
        streams, finishes = [], []
        for _ in procs:
            got_streams, got_finishes = queue.get(timeout=600)
            streams += got_streams
            finishes += got_finishes
        for p in procs:
            p.join(30)
        results[n] = summarize(streams, finishes)
    return results


def start_server(args: argparse.Namespace, adapter_dir: Path) -> Server:
    """The server under test on a free gRPC port (HTTP off), its output in ``adapter_dir/server.log``:
    the synthetic engine's, or loraplex-server on the dummy model (with ``--server-switch-interval``,
    that GIL hand-off interval set first)."""
    log = adapter_dir / "server.log"
    if args.engine == "synthetic":
        return launch(["--step-ms", str(args.step_ms)], log, http=False, program=SYNTHETIC_SERVER)
    program = server_with_switch_interval(args.server_switch_interval) if args.server_switch_interval else SERVER
    flags = ["--model-format", "dummy", "--model", args.model, "--device", args.device, "--dtype", args.dtype,
             "--adapter-dir", str(adapter_dir), "--max-num-seqs", "128", "--max-num-batched-tokens", "4096",
             "--num-kv-blocks", str(args.kv_blocks), "--log-level", "WARNING"]
    return launch(flags, log, http=False, program=program)


# ---------------------------------------------------------------- adapters, report

def make_adapters(args: argparse.Namespace, adapter_dir: Path) -> list[str]:
    """A few random rank-16 adapters on all projections of the dummy model, as PEFT files."""
    names = adapter_names(args.adapters)
    write_adapters(args.model, adapter_dir, names, [16])
    return names


def _ms(value: float) -> str:
    return "n/a" if value != value else f"{value:.2f}"  # NaN: not measured (real engine: no time stamps)


def table(inproc: dict[int, dict], grpc_: dict[int, dict], streams: list[int]) -> list[str]:
    lines = ["| streams | path | tokens/s | inter-token p50 / p99 (ms) | first token p50 (ms) "
             "| delivery p50 / p99 (ms) |", "| ---: | --- | ---: | ---: | ---: | ---: |"]
    for n in streams:
        for name, r in (("in-process", inproc[n]), ("gRPC", grpc_[n])):
            lines.append(f"| {n} | {name} | {r['tok_s']:.0f} | {r['itl_p50_ms']:.2f} / {r['itl_p99_ms']:.2f} | "
                         f"{r['ttft_p50_ms']:.1f} | {_ms(r['delivery_p50_ms'])} / {_ms(r['delivery_p99_ms'])} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", choices=("model", "synthetic"), default="model",
                        help="model: the real engine on a dummy model; synthetic: no model (the edge alone)")
    parser.add_argument("--step-ms", type=float, default=1.0, help="synthetic engine: one token per stream per step")
    parser.add_argument("--model", default="tiny", help="dummy preset (tiny, smollm2-135m, llama-7b)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--streams", default="1,16,128")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--adapters", type=int, default=4, help="0: base model only")
    parser.add_argument("--kv-blocks", type=int, default=2048)
    parser.add_argument("--client-procs", type=int, default=max(1, min(8, (os.cpu_count() or 2) // 2)))
    parser.add_argument("--server-switch-interval", type=float, default=0.0,
                        help="sys.setswitchinterval for the server process (0: Python's default, 5 ms)")
    parser.add_argument("--results", default=None,
                        help="write this run's section into this RESULTS.md, in place of the one of its title")
    args = parser.parse_args()
    args.streams = [int(s) for s in args.streams.split(",")]
    adapter_dir = Path(tempfile.mkdtemp(prefix="bench-serving-"))
    try:
        adapters = make_adapters(args, adapter_dir) if args.engine == "model" else [f"a{i}" for i in range(args.adapters)]
        inproc = asyncio.run(run_in_process(args, adapter_dir, adapters))
        server = start_server(args, adapter_dir)
        try:
            over_grpc = run_rounds_over_grpc(args, server.grpc_address, adapters)
        finally:
            server.stop()
    finally:
        shutil.rmtree(adapter_dir, ignore_errors=True)
    lines = table(inproc, over_grpc, args.streams)
    print("\n".join(lines))
    if args.results:
        from benchmarks.common.results import record_results

        engine = (f"synthetic engine (no model, a token per stream every {args.step_ms} ms)"
                  if args.engine == "synthetic" else f"dummy {args.model} on {args.device} ({args.dtype})")
        title = (f"Serving edge: gRPC vs in-process, {engine}, {args.new_tokens} new tokens, "
                 f"{args.adapters} adapters + base")
        command = "python -m benchmarks.serving.bench_grpc_vs_inprocess " + " ".join(sys.argv[1:])
        record_results(Path(args.results), title, command, lines,
                       notes=f"Client: {args.client_procs} worker processes with raw grpc.aio stubs on loopback."
                              + (f" Server GIL switch interval {args.server_switch_interval} s."
                                 if args.server_switch_interval else ""))


if __name__ == "__main__":
    main()
