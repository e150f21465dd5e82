"""Where one decode step's time goes: 7B-shaped model, batch 32, on the GPU.

Fills the engine with 32 requests of a given prompt length, lets them reach decode, then
for the base model and for 32 distinct adapters reports:
- the whole step as the engine sees it (ModelRunner.execute: plan, LoRA tables, staging,
  graph replay, sampling with its host sync), median over steps;
- the graph replay alone, timed with CUDA events (GPU time of the captured forward);
- the GPU kernels of replayed steps from torch.profiler, grouped: GEMM, decode attention,
  LoRA (shrink/expand), other (norms, rotary, activation, copies); and the step's CPU
  stages: planning, LoRA table build, staging, sampling and the engine's bookkeeping.

    python -m benchmarks.engine.profile_decode_step [--prompt-len 512] [--out profile.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch


from benchmarks.engine import bench_textgen

from loraplex.inference_server.engine.request import GenerationRequest, SamplingParams, StoppingCriteria

CATEGORIES = (("attention", ("paged_decode",)), ("lora", ("lora_",)),
              ("gemm", ("gemm", "xmma", "cutlass", "nvjet", "sm90", "cublas")))


def category(name: str) -> str:
    low = name.lower()
    return next((cat for cat, keys in CATEGORIES if any(k in low for k in keys)), "other")


def fill(engine, ids: list[str | None], prompt_len: int, new_tokens: int) -> None:
    """Requests for the adapters ``ids`` (None: the base model) until all decode. Each prompt starts
    with its own token, so the prefix cache shares no KV block between them: every workload's
    attention reads what a Distinct batch's does (shared prompts made base and Identical steps'
    attention read cached blocks from L2, 5.65 against 9.65 ms at B128)."""
    core, manager = engine._core, engine._manager
    for i, aid in enumerate(ids):
        prompt = (10 + i, *range(11, 10 + prompt_len))
        request = GenerationRequest(f"p{i}-{time.monotonic_ns()}", prompt, aid,
                                    SamplingParams(), StoppingCriteria(max_new_tokens=new_tokens, ignore_eos=True))
        core.add_request(request, manager.acquire(aid) if aid else None)
    while any(s.num_computed < len(s.token_ids) - 1 for s in core._seqs.values()):  # until all decode
        core.step()


def timed_stages(engine, steps: int) -> dict[str, float]:
    """Median ms per stage of the step, by wrapping the runner's pieces."""
    runner, core = engine._core.runner, engine._core
    stages: dict[str, list[float]] = {}

    def wrap(obj, name, key):
        original = getattr(obj, name)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            out = original(*a, **kw)
            stages.setdefault(key, []).append(time.perf_counter() - t0)
            return out

        setattr(obj, name, timed)
        return original

    saved = [(runner.lora_builder, "build", wrap(runner.lora_builder, "build", "lora tables")),
             (runner.graphs, "_stage", wrap(runner.graphs, "_stage", "staging")),
             (runner, "execute", wrap(runner, "execute", "runner.execute")),
             (runner, "launch", wrap(runner, "launch", "runner.launch (no GPU wait)")),
             (core, "step", wrap(core, "step", "engine step"))]
    import loraplex.inference_server.engine.model_runner as mr

    plan, sample = mr.plan_step, mr.sample
    mr.plan_step = lambda *a: _time(stages, "plan", plan, *a)
    mr.sample = lambda *a: _time(stages, "sample (+ GPU wait)", sample, *a)
    try:
        for _ in range(steps):
            core.step()
    finally:
        mr.plan_step, mr.sample = plan, sample
        for obj, name, original in saved:
            setattr(obj, name, original)
    return {k: statistics.median(v) * 1e3 for k, v in stages.items()}


def _time(stages, key, fn, *a):
    t0 = time.perf_counter()
    out = fn(*a)
    stages.setdefault(key, []).append(time.perf_counter() - t0)
    return out


def replay_ms(engine, size: int, lora: bool, reps: int = 20) -> float:
    graph, _ = engine._core.runner.graphs.graphs[(size, lora)]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def recaptured_ab(engine, size: int, variants: dict, restore, rounds: int = 3) -> dict[str, list[float]]:
    """Replay ms of the LoRA graph of ``size`` rows captured after each variant's setup (name -> a
    function setting the engine or the kernels up), in turn for ``rounds`` rounds; then ``restore()``
    and the graph captured once more as the engine runs it."""
    graphs = engine._core.runner.graphs
    out: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for _ in range(rounds):
            for name, setup in variants.items():
                setup()
                graphs.graphs[(size, True)] = graphs._capture_one(size, True, None)
                out[name].append(replay_ms(engine, size, True, reps=50))
    finally:
        restore()
        graphs.graphs[(size, True)] = graphs._capture_one(size, True, None)
    return out


def stream_ab(engine, size: int, variants: dict) -> dict[str, list[float]]:
    """recaptured_ab over LoRA side streams (name -> a function making it, or None: the shrinks
    on the main stream); the last variant's stream is kept."""
    graphs = engine._core.runner.graphs
    kept = list(variants.values())[-1]

    def use(make):
        return lambda: setattr(graphs, "lora_stream", make())

    return recaptured_ab(engine, size, {name: use(make) for name, make in variants.items()}, use(kept))


def side_stream_ab(engine, size: int) -> dict[str, list[float]]:
    """The shrinks on one stream vs on a side stream beside the base GEMMs (the engine's, kept)."""
    dev = engine._core.runner.graphs.device
    return stream_ab(engine, size, {"one stream": lambda: None, "side stream": lambda: torch.cuda.Stream(dev)})


def priority_ab(engine, size: int) -> dict[str, list[float]]:
    """The side stream at high vs normal priority (the engine's, kept); lower numbers are
    higher, PyTorch clamps to the device's range."""
    dev = engine._core.runner.graphs.device
    return stream_ab(engine, size, {"high priority": lambda: torch.cuda.Stream(dev, priority=-1),
                                    "normal priority": lambda: torch.cuda.Stream(dev, priority=0)})


def run_items_ab(engine, size: int) -> dict[str, list[float]]:
    """LoRA graph replays with row_slot's runs as the items of neither, one or both decode kernels
    (loraplex.kernels.cuda._launch.RUN_ITEMS; without them the expand takes one row per item and the shrink
    seg's 4-row tiles), and with one-row items in both (_plan.ONE_ROW_ITEMS_ROWS raised to the batch).
    Calls of up to ONE_ROW_ITEMS_ROWS rows take one-row items either way."""
    from loraplex.kernels.cuda import _launch, _plan

    default, one_row = _launch.RUN_ITEMS, _plan.ONE_ROW_ITEMS_ROWS
    kernels = {"neither": (), "shrink": ("shrink",), "expand": ("expand",), "both": ("shrink", "expand")}

    def use(names, one_row_rows=one_row):
        def setup():
            _launch.RUN_ITEMS = frozenset(names)
            _plan.ONE_ROW_ITEMS_ROWS = one_row_rows
        return setup

    variants = {f"runs in {k}": use(v) for k, v in kernels.items()}
    variants["one-row items in both"] = use(default, max(one_row, size))
    return recaptured_ab(engine, size, variants, use(default))


def shrink_first_ab(engine, size: int) -> dict[str, list[float]]:
    """LoRA graph replays as the engine captures it (each shrink on the side stream beside its base
    GEMM, the expand joining both) and with each shrink on the main stream before its GEMM (no fork,
    no join; the expand follows the GEMM)."""
    from loraplex.inference_server.lora import batch as lora_batch

    original = lora_batch.LoraBatch.apply

    def shrink_first(self, x, layer, group, base):
        if group not in self.active:
            return base(x)
        width = sum(self.widths[group])  # the shrink reads x only; y's shape passes its checks
        self._sgmv(x.new_empty(x.shape[0], width), x, layer, group, "shrink")
        y = base(x)
        self._sgmv(y, x, layer, group, "expand")
        return y

    def use(apply):
        return lambda: setattr(lora_batch.LoraBatch, "apply", apply)

    return recaptured_ab(engine, size, {"side stream": use(original), "shrink first": use(shrink_first)},
                         use(original))


def print_replays(title: str, replays: dict[str, list[float]]) -> None:
    print(f"   {title}: " + "; ".join(f"{k} {', '.join(f'{v:.2f}' for v in vs)}" for k, vs in replays.items()),
          flush=True)


def _ablated_applies(original, original_apply):
    """LoraBatch.apply replacements: the bare base projection, and the shrink forked beside the
    GEMM as the engine does but never joined back (the expand does not wait for it)."""

    def plain(self, x, layer, group, base):
        return base(x)

    def forks_only(self, x, layer, group, base):
        if self.side_stream is None or group not in self.active:
            return original_apply(self, x, layer, group, base)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(x.device))
        y = base(x)
        self.side_stream.wait_event(ready)
        with torch.cuda.stream(self.side_stream):
            if "shrink" not in self.skip:
                original(self, y, x, layer, group, "shrink")
        if "expand" not in self.skip:
            original(self, y, x, layer, group, "expand")  # timing only: it does not wait for its shrink
        return y

    return plain, forks_only


def _skipping(original, skip: tuple[str, ...]):
    """LoraBatch._sgmv without the stages in ``skip``."""
    def _sgmv(self, y, x, layer, group, stage):
        for st in ("shrink", "expand") if stage == "both" else (stage,):
            if st not in skip:
                original(self, y, x, layer, group, st)
    return _sgmv


def ablation(engine, size: int, rounds: int = 3) -> dict[str, list[float]]:
    """Replay ms of the LoRA graph of ``size`` rows re-captured with a LoRA stage left out
    (the tables unchanged): what each stage costs on the step's critical path. "no LoRA
    kernels" keeps the side stream's fork and join around each base projection; "no fork/join"
    leaves the bare base projections in the LoRA graph, so against the base graph it shows
    whatever else the LoRA graph adds. "forks only" forks each shrink off as the engine does but
    joins the side stream once, before the logits, instead of before each expand: what the
    joins cost apart from the forks. The outputs of the ablated graphs are wrong by design; the
    full graph is captured again at the end."""
    from loraplex.inference_server.lora import batch as lora_batch

    graphs = engine._core.runner.graphs
    original, original_apply = lora_batch.LoraBatch._sgmv, lora_batch.LoraBatch.apply
    plain, forks_only = _ablated_applies(original, original_apply)
    variants = {"full": (original_apply, ()), "no expand": (original_apply, ("expand",)),  # name -> (apply, skip)
                "no shrink": (original_apply, ("shrink",)),
                "no LoRA kernels": (original_apply, ("shrink", "expand")),
                "no LoRA kernels, no fork/join": (plain, ()),
                "forks only, one join at the end": (forks_only, ()),
                "no LoRA kernels, forks only": (forks_only, ("shrink", "expand"))}
    out: dict[str, list[float]] = {name: [] for name in variants}
    model, logits = graphs.model, graphs.model.compute_logits

    # only the forks-only variants join here: the others join per projection, and a graph that
    # never forked the side stream must not wait on it (work outside the capture)
    joins_at_end = False

    def joined_logits(hidden):  # every side-stream branch joins the main stream here
        if joins_at_end:
            torch.cuda.current_stream(hidden.device).wait_stream(graphs.lora_stream)
        return logits(hidden)

    model.compute_logits = joined_logits
    lora_batch.LoraBatch.skip = ()
    try:
        for _ in range(rounds):
            for name, (apply, skip) in variants.items():
                lora_batch.LoraBatch.apply, lora_batch.LoraBatch._sgmv = apply, _skipping(original, skip)
                lora_batch.LoraBatch.skip = skip
                joins_at_end = apply is forks_only and graphs.lora_stream is not None
                graphs.graphs[(size, True)] = graphs._capture_one(size, True, None)
                out[name].append(replay_ms(engine, size, True, reps=50))
    finally:
        del model.compute_logits, lora_batch.LoraBatch.skip
        lora_batch.LoraBatch._sgmv, lora_batch.LoraBatch.apply = original, original_apply
        graphs.graphs[(size, True)] = graphs._capture_one(size, True, None)
    out["base graph"] = [replay_ms(engine, size, False, reps=50) for _ in range(rounds)]
    return out


def timeline(engine, size: int, lora: bool, layer: int = 16) -> list[str]:
    """One replay's kernels from the start of layer ``layer``'s attention kernel to the next
    one: start offset, duration and gap after the previous kernel's end (us), stream, name."""
    from torch.profiler import ProfilerActivity, profile

    graph, _ = engine._core.runner.graphs.graphs[(size, lora)]
    graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    evts = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                  key=lambda e: e.time_range.start)
    attn = [i for i, e in enumerate(evts) if "paged_decode<" in e.name]
    if len(attn) <= layer + 1:
        return [f"(only {len(attn)} attention kernels in the trace)"]
    window = evts[attn[layer]: attn[layer + 1] + 1]
    t0, last_end, lines = window[0].time_range.start, window[0].time_range.start, []
    for e in window:
        start, end = e.time_range.start, e.time_range.end
        lines.append(f"{start - t0:8.1f} {end - start:7.1f} {start - last_end:6.1f}  "
                     f"s{getattr(e, 'device_resource_id', '?')}  {e.name[:80]}")
        last_end = max(last_end, end)
    return lines


def kernel_breakdown(engine, steps: int) -> dict[str, float]:
    """GPU ms per step by kernel category, from torch.profiler over ``steps`` engine steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine._core.step()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    top: dict[str, float] = {}
    for evt in prof.key_averages():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = evt.self_device_time_total if hasattr(evt, "self_device_time_total") else evt.self_cuda_time_total
        totals[category(evt.key)] = totals.get(category(evt.key), 0.0) + us / 1e3 / steps
        top[evt.key[:90]] = us / 1e3 / steps
    totals["top kernels"] = dict(sorted(top.items(), key=lambda kv: -kv[1])[:12])
    return totals


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-7b")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-lora-rank", type=int, default=None,
                    help="the engine's rank cap (default: --rank; the server's default is 128)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--side-stream-ab", action="store_true",
                    help="also time the Distinct graph with and without the LoRA side stream")
    ap.add_argument("--ablate", action="store_true",
                    help="also time the LoRA graphs with the shrinks / expands left out, and print one layer's timeline")
    ap.add_argument("--priority-ab", action="store_true",
                    help="also time the LoRA graphs with the side stream at normal vs high priority")
    ap.add_argument("--items-ab", action="store_true",
                    help="also time the LoRA graphs with and without row_slot's runs as the decode items")
    ap.add_argument("--shrink-first-ab", action="store_true",
                    help="also time the LoRA graphs with each shrink before its GEMM on the main stream")
    ap.add_argument("--workloads", default="base,distinct", help="of base, distinct, identical, uniform")
    args = ap.parse_args()
    ns = argparse.Namespace(model=args.model, rank=args.rank, max_lora_rank=args.max_lora_rank, max_batch=args.batch,
                            max_len=2048, num_adapters=args.batch, eager=False)
    engine = bench_textgen.build_engine(ns)
    report = {}
    rows = {"base": [None] * args.batch, "distinct": [f"a{i}" for i in range(args.batch)],
            "identical": ["a0"] * args.batch,  # uniform: Punica's ceil(sqrt(batch)) adapters
            "uniform": [f"a{i % (math.isqrt(args.batch - 1) + 1)}" for i in range(args.batch)]}
    for name in args.workloads.split(","):
        ids = rows[name]
        fill(engine, ids, args.prompt_len, 200)
        stages = timed_stages(engine, 20)
        lora = name != "base"
        gpu = replay_ms(engine, args.batch, lora)
        kernels = kernel_breakdown(engine, 5)
        report[name] = dict(stages_ms=stages, replay_gpu_ms=gpu, kernels_ms_per_step=kernels)
        print(f"== {name}: replay (GPU) {gpu:.2f} ms; stages (ms): "
              + ", ".join(f"{k} {v:.2f}" for k, v in stages.items()), flush=True)
        print("   kernels (ms/step): " + ", ".join(f"{k} {v:.2f}" for k, v in kernels.items() if k != "top kernels"))
        for k, v in kernels["top kernels"].items():
            print(f"     {v:7.3f}  {k}")
        if lora and args.side_stream_ab:
            ab = side_stream_ab(engine, args.batch)
            report[name]["side_stream_ab_replay_ms"] = ab
            print_replays("LoRA graph replay (ms), shrinks beside the GEMMs vs on one stream", ab)
        if lora and args.items_ab:
            ab = run_items_ab(engine, args.batch)
            report[name]["items_ab_replay_ms"] = ab
            print_replays("LoRA graph replay (ms), decode items", ab)
            report[name]["base_graph_ms"] = replay_ms(engine, args.batch, False, reps=50)
            print(f"   base graph replay (this workload's KV) {report[name]['base_graph_ms']:.2f} ms", flush=True)
        if lora and args.shrink_first_ab:
            ab = shrink_first_ab(engine, args.batch)
            report[name]["shrink_first_ab_replay_ms"] = ab
            print_replays("LoRA graph replay (ms), where the shrink runs", ab)
        if lora and args.priority_ab:
            ab = priority_ab(engine, args.batch)
            report[name]["priority_ab_replay_ms"] = ab
            print_replays("LoRA graph replay (ms), side stream priority", ab)
        if args.ablate:
            print("   timeline of one layer (start, duration, gap; us):")
            for line in timeline(engine, args.batch, lora):
                print("     " + line)
        if lora and args.ablate:
            ab = ablation(engine, args.batch)
            report[name]["ablation_replay_ms"] = ab
            print_replays("LoRA graph replay (ms) with stages left out", ab)
        for rid in list(engine._core._seqs):
            engine._core.abort(rid)
        engine._core.step()
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
