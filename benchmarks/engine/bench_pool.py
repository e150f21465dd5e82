"""Adapter pool: load latency per tier, where a source load goes, and (GPU) time to first
token per tier and decode step time while adapters load.

    python -m benchmarks.engine.bench_pool [--layers 32] [--results benchmarks/RESULTS.md]
    python -m benchmarks.engine.bench_pool --redis-url redis://127.0.0.1:6379/0   # + TTFT of Redis-only adapters
    python -m benchmarks.engine.bench_pool --device cpu --threads 1   # the loader's CPU work alone

7B-shaped Llama (hidden 4096, 32 layers, 32 heads, intermediate 11008, vocab 32000),
rank-16 adapters on all 7 projections (~80 MB each in bf16). The adapter source is in
memory (the bytes a Redis hit would hand over; resolving hashes them, as the store client
checks its sha256), so "source" rows time sha256 + validation + staging into the host tier
+ the host-to-device copy and the layout on the device, without network; ``--redis-url``
adds adapters that only a real Redis holds (benchmarks/engine/pool_ttft.py). On the GPU the
model has random bf16 weights and the decode rows run the engine (CUDA-graph decode steps
unless ``--eager``); ``--device cpu`` builds only the adapter manager (pool and host tier
on the CPU, the "device" is the CPU).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

from benchmarks.engine.pool_ttft import RoutedSource, ms, redis_source, ttft_rows
from benchmarks.common.random_adapters import RandomAdapterSource
from benchmarks.common.results import record_results

from loraplex.inference_server.engine import cpu_threads
from loraplex.inference_server.engine.async_engine import AsyncEngine
from loraplex.inference_server.engine.config import EngineConfig
from loraplex.inference_server.engine.factory import assemble
from loraplex.inference_server.engine.request import GenerationRequest, StoppingCriteria
from loraplex.inference_server.lora.pool.device_packing import plan_device_pack, stage
from loraplex.inference_server.main import configure_interpreter
from loraplex.inference_server.lora.pool.adapter_pool import AdapterPool
from loraplex.inference_server.lora.pool.packing import pack_adapter, plan_layout
from loraplex.adapter_store.format.peft_format import WEIGHTS_FILE, parse_adapter_files
from loraplex.inference_server.lora.pool.tensor_views import tensor_views
from loraplex.inference_server.model.config import ModelConfig
from loraplex.inference_server.model.dummy import byte_level_tokenizer
from loraplex.inference_server.model.llama import LlamaForCausalLM

REDIS_ADAPTERS = 5  # adapters stored only in Redis, with --redis-url


def build(cfg: ModelConfig, rank: int, eager: bool, redis_url: str | None) -> AsyncEngine:
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    for name, p in model.named_parameters():
        torch.nn.init.ones_(p) if name.endswith("norm.weight") else torch.nn.init.normal_(p, 0.0, 0.02)
    model.init_rotary("cuda")
    model.eval().requires_grad_(False)
    config = EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=32, max_num_batched_tokens=4096,
                          adapter_pool_bytes=2 << 30, adapter_host_cache_bytes=6 << 30, num_kv_blocks=4096,
                          max_lora_rank=rank, enforce_eager=eager)
    source = RandomAdapterSource(cfg, rank)
    if redis_url:
        source = RoutedSource(source, redis_source(redis_url, cfg, source.files, REDIS_ADAPTERS))
    return assemble(AsyncEngine, config, model, cfg, byte_level_tokenizer(cfg.vocab_size), source)


def timed_acquire(mgr, adapter_id: str) -> float:
    t0 = time.perf_counter()
    mgr.release(mgr.acquire(adapter_id))
    return time.perf_counter() - t0


def stage_times(mgr: AdapterPool, cfg: ModelConfig, reps: int = 5) -> dict[str, float]:
    """Where a source load goes (median of ``reps``), and the previous loader's CPU packing
    (``pack_adapter`` on zero-copy views, into a host buffer) for comparison."""
    files, dev = mgr.source.files, mgr.pool.device
    weights = files[WEIGHTS_FILE]
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    out: dict[str, list[float]] = {}

    def timed(name: str, fn):
        t0 = time.perf_counter()
        result = fn()
        sync()
        out.setdefault(name, []).append(time.perf_counter() - t0)
        return result

    layout = plan_layout(mgr.source.spec, cfg)
    dst = torch.empty(layout.num_elements, dtype=mgr.dtype, device=dev)  # kept: warm pages, as the pool's
    packed = torch.zeros(layout.num_elements, dtype=mgr.dtype)
    for _ in range(reps):
        timed("resolve (sha256 of the bytes)", lambda: mgr.source.resolve("stages"))
        spec = timed("validate", lambda: parse_adapter_files(files, cfg))
        plan, table = timed("plan (header, gather index)", lambda: plan_device_pack(spec, weights, layout, cfg))
        buffer, start = mgr.host.reserve(plan.staged_bytes, torch.uint8, zero=False)
        timed("stage: memcpy into the host arena", lambda: stage(weights, plan, table, buffer))
        where = "H2D + layout on the GPU side stream" if dev.type == "cuda" else "layout on the CPU (the device here)"
        timed(where, lambda: mgr._copier.unpack(dst, buffer, plan, layout))
        mgr.host.abandon(start)
        timed("was: zero + views + pack on the CPU (transposes)",
              lambda: pack_adapter(spec, tensor_views(weights), cfg, mgr.dtype, out=packed.zero_()))
        if not torch.equal(dst.cpu(), packed):
            raise AssertionError("the device layout differs from the CPU packing")
    return {k: statistics.median(v) for k, v in out.items()}


def tier_times(mgr: AdapterPool, loads: int) -> tuple[list[float], list[float], list[float]]:
    """(source -> pool, host tier -> pool, resident) acquire times."""
    timed_acquire(mgr, "warm")  # first call: allocator, pinned buffers
    mgr.invalidate("warm")
    source_s = [timed_acquire(mgr, f"cold-{i}") for i in range(loads)]  # source -> host tier -> pool
    # the oldest in the host tier: evicted from the pool by now, or evicted by the reloads before them
    host_ids = [f"cold-{i}" for i in range(loads) if f"cold-{i}" in mgr.host.versions()][:5]
    hits_before = mgr.stats().counters["host_hits"]
    host_s = [timed_acquire(mgr, i) for i in host_ids]
    if mgr.stats().counters["host_hits"] - hits_before != len(host_s):
        raise AssertionError("expected host-tier hits only (pool and host tier sizes)")
    resident_s = [timed_acquire(mgr, host_ids[-1]) for _ in range(5)]
    return source_s, host_s, resident_s


def step_times(core, n: int) -> list[float]:
    """Periods of n consecutive engine steps (no sync between them: the engine may launch a
    step before reading the previous one's tokens, so a step's cost is its period)."""
    out = []
    t0 = time.perf_counter()
    for _ in range(n):
        core.step()
        t1 = time.perf_counter()
        out.append(t1 - t0)
        t0 = t1
    return out


IDLE_STEPS = 150  # each idle window between two loading phases


def steps_while(core, work, one_thread: bool = True) -> list[float]:
    """Step periods while ``work`` runs on a loader thread (with one intra-op thread, as the
    engine's loader threads in AsyncEngine, unless ``one_thread`` is False): the steps that
    started before it ended, at least the first."""
    def run() -> None:
        if one_thread:
            cpu_threads.one_intra_op_thread()
        work()

    loader = threading.Thread(target=run)
    loader.start()
    busy = step_times(core, 1)  # at least one: a phase can end before the first step does
    while loader.is_alive():
        busy += step_times(core, 1)
    loader.join()
    return busy


def load_phases(mgr: AdapterPool, split: bool) -> list[tuple[str, object, bool]]:
    """(name, work, one intra-op thread) of each loading phase: 20 full loads; with ``split``,
    the host half alone (at one and at torch's default threads) and the GPU half alone (host
    tier -> pool, back to back, over more adapters than the pool's free places)."""
    phases = [("20 adapters loading", lambda: [timed_acquire(mgr, f"load-{i}") for i in range(20)], True)]
    if not split:
        return phases
    ids = [f"h-{i}" for i in range(20)] + [f"run-{i}" for i in range(4, 20)]

    def host_to_pool() -> None:
        for i in ids[20:]:
            mgr.prefetch(i)
        for _ in range(3):
            for i in ids:
                timed_acquire(mgr, i)

    return phases + [
        ("20 adapters source -> host tier only", lambda: [mgr.prefetch(i) for i in ids[:20]], True),
        ("20 adapters source -> host tier only, loader at torch's default threads",
         lambda: [mgr.prefetch(f"h-{i}") for i in range(40, 60)], False),
        ("host tier -> pool only, 108 loads back to back", host_to_pool, True),
    ]


def decode_rows(engine, mgr, split: bool) -> list[str]:
    """Decode step time of 32 running requests during each loading phase (``load_phases``),
    against the mean of the idle windows right before and after it: the step grows with the
    context, so a phase is not compared with the first steps."""
    core = engine._core
    for i in range(32):
        request = GenerationRequest(f"d{i}", tuple(range(5, 133)), f"run-{i % 4}",
                                    stopping=StoppingCriteria(max_new_tokens=1800, ignore_eos=True))
        core.add_request(request, mgr.acquire(request.adapter_id))
    step_times(core, 3)  # prefill + warm-up
    idle = [step_times(core, IDLE_STEPS)]
    rows = []
    for k, (name, work, one_thread) in enumerate(load_phases(mgr, split)):
        busy = steps_while(core, work, one_thread)
        idle.append(step_times(core, IDLE_STEPS))
        base = (ms(idle[-2]) + ms(idle[-1])) / 2
        target = " (target <= +5%)" if k == 0 else ""
        rows.append(f"| decode step, batch 32, {name} ({len(busy)} steps) | {ms(busy):.2f} ms "
                    f"(idle around it {base:.2f} ms) | {(ms(busy) / base - 1) * 100:+.1f}%{target} |")
    return [f"| decode step, batch 32, no loads (first idle window) | {ms(idle[0]):.2f} ms | |", *rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--eager", action="store_true", help="GPU: no CUDA graphs for decode steps")
    parser.add_argument("--split-loads", action="store_true",
                        help="GPU: also time steps while only the host half or only the GPU half of loads runs")
    parser.add_argument("--redis-url", default=None,
                        help="GPU: also time the first token of adapters stored only in this Redis (redis://...)")
    parser.add_argument("--results", default=None)
    parser.add_argument("--switch-interval-ms", type=float, default=None,
                        help="Python's GIL switch interval (default: the server's, loraplex.inference_server.main)")
    args = parser.parse_args()
    if args.switch_interval_ms is None:
        configure_interpreter()
    else:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = ModelConfig(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                      num_layers=args.layers, num_heads=32, num_kv_heads=32, head_dim=128,
                      max_position_embeddings=4096, name="llama-7b-dummy")
    if args.device == "cuda":
        engine = build(cfg, args.rank, args.eager, args.redis_url)
        mgr, loads = engine._manager, 30
    else:  # the manager alone: pool for 3 adapters, host tier for 6
        engine, source, loads = None, RandomAdapterSource(cfg, args.rank), 12
        n = plan_layout(source.spec, cfg).num_elements
        mgr = AdapterPool(source, cfg, 3 * (n + 64), torch.bfloat16, "cpu", host_cache_bytes=6 * (2 * n + (1 << 20)))
    source_s, host_s, resident_s = tier_times(mgr, loads)
    entry = mgr.host.lease(f"cold-{loads - 1}")
    mb = entry.num_bytes / 1e6
    mgr.host.release(entry)
    stages = stage_times(mgr, cfg)
    on_gpu = args.device == "cuda"
    where = "pinned H2D + layout on the side stream" if on_gpu else "layout on the CPU"
    host_target, source_target = ("<= 3 ms", "<= 100 ms (Redis hit)") if on_gpu else ("", "")  # GPU targets
    table = [
        "| measure | median | target |", "| --- | ---: | ---: |",
        f"| adapter size (bf16, rank {args.rank}, 7 projections x {args.layers} layers) | {mb:.1f} MB | |",
        f"| acquire, resident in the pool | {ms(resident_s):.3f} ms | |",
        f"| acquire, host tier -> pool ({where}) | {ms(host_s):.2f} ms | {host_target} |",
        f"| acquire, source bytes -> sha256, validate, stage -> pool | {ms(source_s):.1f} ms | {source_target} |",
        *[f"| source load stage: {k} | {v * 1e3:.1f} ms | |" for k, v in stages.items()],
        *(ttft_rows(engine, mgr, REDIS_ADAPTERS if args.redis_url else 0) if engine is not None else []),
        *(decode_rows(engine, mgr, args.split_loads) if engine is not None else []),
    ]
    print("\n".join(table))
    if args.results:
        mode = "eager engine" if args.eager else "engine with CUDA-graph decode steps"
        title = (f"Adapter pool on the GPU (7B-shaped, {mode})" if engine is not None
                 else f"Adapter pool on the CPU (7B-shaped, manager only, torch threads: {torch.get_num_threads()})")
        command = "python -m benchmarks.engine.bench_pool " + " ".join(sys.argv[1:])
        record_results(Path(args.results), title, command, table)


if __name__ == "__main__":
    main()
