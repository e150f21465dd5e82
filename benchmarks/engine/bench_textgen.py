"""Punica's text-generation benchmark on the GPU engine, plus transformers + PEFT on one batch.

Workload (Punica's benchmarks/engine/bench_textgen.py): N requests (default 1000), prompt lengths
from a log-normal (scipy's lognorm(0.8, -1, 18): median ~17 tokens), total lengths uniform
in [0, max_len), greedy, every request runs to its drawn length (EOS ignored), FCFS, max
batch 32, all requests queued at the start. One engine (7B-shaped Llama, random weights
drawn on the GPU, bf16, rank-16 random adapters on all 7 projections) serves, in one run:

- Distinct: request i uses adapter i mod 64, so the 32 running requests are all different;
- Uniform: ceil(sqrt(32)) = 6 adapters, drawn uniformly;
- Skewed: Zipf(1.5) over 64 adapters;
- Identical: one adapter;
- base: no adapter (the reference for the LoRA overhead).

Every adapter is made resident before timing (the pool holds them all). Reported per
workload: throughput ((prompt + generated) tokens / wall), generated tokens/s, per-token
latency (gaps between a request's tokens) p50/p99, time to first token p50/p99, and the
median decode step at batch 32 against its HBM roofline (weights + KV bytes read / the
card's copy bandwidth, measured at start; with the adapters' bytes too). Then transformers + PEFT generate one fixed
batch (32 requests x 128 prompt + 128 new tokens, 4 adapters mixed through
``adapter_names``), and loraplex runs the same batch shape.

    python -m benchmarks.engine.bench_textgen [--num-requests 1000] [--model llama-7b] \
        [--results benchmarks/RESULTS.md]

Longer than one call on a lent GPU may run: split the workloads over calls made back to back
on the same machine with ``--parts-dir`` (a folder outside the working tree, e.g. /tmp/textgen);
each call's table, and its ``--results`` section, is built from every part so far.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch


from benchmarks.engine import textgen_parts
from benchmarks.engine.eager_profile import wrap_eager_steps
from benchmarks.common.gpu_ceilings import measure_copy_bandwidth
from benchmarks.common.random_adapters import PROJ, RandomAdapterSource
from benchmarks.common.results import record_results

from loraplex.inference_server.engine.async_engine import AsyncEngine
from loraplex.inference_server.engine.config import EngineConfig
from loraplex.inference_server.engine.factory import assemble
from loraplex.inference_server.engine.request import GenerationRequest, SamplingParams, StoppingCriteria
from loraplex.inference_server.model import attention
from loraplex.inference_server.model.checkpoint import ModelSource
from loraplex.inference_server.model.loading import load_checkpoint
from loraplex.inference_server.model.weights import build_model

WORKLOADS = ("distinct", "uniform", "skewed", "identical", "base")


def request_set(n: int, max_len: int, seed: int) -> list[tuple[int, int]]:
    """(prompt length, new tokens) per request, Punica's distributions."""
    rng = np.random.default_rng(seed)
    prompts = np.floor(-1.0 + 18.0 * np.exp(0.8 * rng.standard_normal(n))).astype(int)
    prompts = np.clip(prompts, 1, max_len - 1)
    totals = rng.integers(0, max_len, n)
    outputs = np.clip(totals - prompts, 1, max_len - prompts)
    return list(zip(prompts.tolist(), outputs.tolist()))


def adapter_ids(workload: str, n: int, batch: int, num_adapters: int, seed: int) -> list[str | None]:
    rng = np.random.default_rng(seed + 1)
    if workload == "base":
        return [None] * n
    if workload == "identical":
        return ["a0"] * n
    if workload == "distinct":
        return [f"a{i % num_adapters}" for i in range(n)]
    if workload == "uniform":
        return [f"a{i}" for i in rng.integers(0, math.ceil(math.sqrt(batch)), n)]
    weights = 1.0 / np.arange(1, num_adapters + 1) ** 1.5
    return [f"a{i}" for i in rng.choice(num_adapters, n, p=weights / weights.sum())]


@dataclass
class StepLog:
    """Per engine step: (seconds, sequences, new tokens, context tokens read) of the step the
    runner started in it (run to completion, or launched ahead: then the seconds are those
    of the engine call that launched it, which in steady state is one step's period)."""

    steps: list[tuple[float, int, int, int]] = field(default_factory=list)
    started: tuple[int, int, int] | None = None  # (sequences, new tokens, context) of the last runner call
    in_step: float = 0.0  # seconds inside every engine step, those that started nothing included


def instrument(engine: AsyncEngine, log: StepLog) -> None:
    core, runner = engine._core, engine._core.runner

    def recording(original):
        def call(seqs, num_tokens, *rest):
            ctx = sum(s.num_computed + n for s, n in zip(seqs, num_tokens))
            out = original(seqs, num_tokens, *rest)
            if out is not None:
                log.started = (len(seqs), sum(num_tokens), ctx)
            return out
        return call

    runner.execute = recording(runner.execute)
    if getattr(runner, "can_launch", False):
        runner.launch = recording(runner.launch)
    step = core.step

    def timed_step():
        log.started = None
        t0 = time.perf_counter()
        events = step()
        seconds = time.perf_counter() - t0
        log.in_step += seconds
        if log.started is not None:
            log.steps.append((seconds, *log.started))
        return events

    core.step = timed_step


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def submit_and_drain(engine: AsyncEngine, requests: list[tuple[tuple[int, ...], str | None, int]],
                     prefix: str, sampled: frozenset[int] = frozenset(), penalty: float = 1.0) -> dict[str, list[float]]:
    """Queue (prompt, adapter, new tokens) requests on the engine core and step until all are
    done: each request's token arrival times (perf_counter), by request id. Requests whose
    index is in ``sampled`` sample (temperature 0.8, top-p 0.95, seeded, repetition ``penalty``);
    the others are greedy."""
    core, manager = engine._core, engine._manager
    for i, (prompt, aid, new_tokens) in enumerate(requests):
        params = (SamplingParams(temperature=0.8, top_p=0.95, seed=i, repetition_penalty=penalty) if i in sampled
                  else SamplingParams())
        request = GenerationRequest(f"{prefix}{i}", prompt, aid, params,
                                    StoppingCriteria(max_new_tokens=new_tokens, ignore_eos=True))
        core.add_request(request, manager.acquire(aid) if aid else None)
    times: dict[str, list[float]] = {}
    while core.has_work():
        events = core.step()
        now = time.perf_counter()
        for e in events:
            times.setdefault(e.request_id, []).extend([now] * len(e.token_ids))
    return times


def run_workload(engine: AsyncEngine, reqs, ids, vocab: int, seed: int, log: StepLog,
                 sampled_share: float = 0.0, penalty: float = 1.0) -> dict:
    rng = np.random.default_rng(seed + 2)
    log.steps.clear()
    log.in_step = 0.0
    start = time.perf_counter()
    prompts = [tuple(rng.integers(3, vocab, plen).tolist()) for plen, _ in reqs]
    sampled = frozenset(np.flatnonzero(rng.random(len(reqs)) < sampled_share).tolist())
    times = submit_and_drain(engine, [(p, aid, olen) for p, (_, olen), aid in zip(prompts, reqs, ids)], "q",
                             sampled, penalty)
    wall = time.perf_counter() - start
    prompt_tokens = sum(p for p, _ in reqs)
    generated = sum(len(t) for t in times.values())
    gaps = [b - a for t in times.values() for a, b in zip(t, t[1:])]
    ttft = [t[0] - start for t in times.values()]
    full = [s for s in log.steps if s[1] == s[2] == max(x[1] for x in log.steps)]
    return dict(
        wall=wall, throughput=(prompt_tokens + generated) / wall, decode_tps=generated / wall,
        tpot_p50=pct(gaps, 0.5) * 1e3, tpot_p99=pct(gaps, 0.99) * 1e3,
        ttft_p50=pct(ttft, 0.5), ttft_p99=pct(ttft, 0.99), generated=generated, prompt=prompt_tokens,
        full_step_ms=statistics.median(s[0] for s in full) * 1e3 if full else float("nan"),
        full_ctx=statistics.median(s[3] for s in full) if full else 0, full_batch=full[0][1] if full else 0,
        steps=len(log.steps), slow_steps=slow_steps(log),
        outside_steps=wall - log.in_step, slowest=sorted(log.steps, reverse=True)[:3],
    )


def slow_steps(log: StepLog) -> int:
    """Steps that took over 3x the median step (a long prompt or recomputed context beside the decodes)."""
    if not log.steps:
        return 0
    median = statistics.median(s[0] for s in log.steps)
    return sum(1 for s in log.steps if s[0] > 3 * median)


def build_engine(args) -> AsyncEngine:
    source = ModelSource(format="dummy", dummy=args.model, seed=0, dummy_device="cuda")
    ckpt = load_checkpoint(source, torch.bfloat16)
    model = build_model(ckpt.config, ckpt.iter_tensors(), "cuda", torch.bfloat16)
    adapters = RandomAdapterSource(ckpt.config, args.rank)
    adapter_bytes = len(adapters.files["adapter_model.safetensors"])
    config = EngineConfig(
        device="cuda", dtype="bfloat16", max_num_seqs=args.max_batch, max_num_batched_tokens=args.max_len,
        max_model_len=args.max_len, max_lora_rank=getattr(args, "max_lora_rank", None) or args.rank,
        kv_cache_memory_fraction=getattr(args, "kv_fraction", 0.5),
        adapter_pool_bytes=int(adapter_bytes * (args.num_adapters + 8)),
        adapter_host_cache_bytes=int(adapter_bytes * 4), enforce_eager=args.eager,
        lora_side_stream=getattr(args, "lora_side_stream", "on") == "on",
    )
    t0 = time.perf_counter()
    engine = assemble(AsyncEngine, config, model, ckpt.config, ckpt.tokenizer, adapters)
    print(f"engine ready in {time.perf_counter() - t0:.1f} s (graphs: {engine._core.runner.graphs is not None})",
          flush=True)
    t0 = time.perf_counter()
    for i in range(args.num_adapters):
        engine._manager.release(engine._manager.acquire(f"a{i}"))
    print(f"{args.num_adapters} adapters resident in {time.perf_counter() - t0:.1f} s", flush=True)
    return engine


def roofline_ms(engine: AsyncEngine, ctx_tokens: int, adapters: int, rank: int,
                bandwidth: float) -> tuple[float, float]:
    """(weights + KV, + adapters) bytes / ``bandwidth`` (bytes/s: the card's measured copy
    bandwidth) of one decode step, in ms."""
    cfg = engine._core.runner.config
    model = engine._core.runner.model
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "embed_tokens" not in n)
    if cfg.tie_word_embeddings:
        weights += model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    kv = ctx_tokens * 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2
    shapes = cfg.projection_shapes()
    lora = adapters * cfg.num_layers * rank * 2 * sum(shapes[p][0] + shapes[p][1] for p in PROJ)
    return (weights + kv) / bandwidth * 1e3, (weights + kv + lora) / bandwidth * 1e3


def fixed_batch_loraplex(engine: AsyncEngine, ids: list[str | None], new_tokens: int, prompt_len: int) -> float:
    start = time.perf_counter()
    prompt = tuple(range(10, 10 + prompt_len))
    times = submit_and_drain(engine, [(prompt, aid, new_tokens) for aid in ids], "f")
    return sum(len(t) for t in times.values()) / (time.perf_counter() - start)


def fixed_batch_hf(model_name: str, rank: int, batch: int, prompt_len: int, new_tokens: int,
                   n_adapters: int) -> tuple[float, float, float]:
    """transformers + PEFT, random 7B-shaped weights, tokens/s: (base model, eager generate; base
    model, static cache, which generate compiles on a GPU; mixed adapters, eager)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from loraplex.inference_server.model.dummy import PRESETS

    p = PRESETS[model_name]
    hf_cfg = LlamaConfig(vocab_size=p["vocab_size"], hidden_size=p["hidden_size"],
                         intermediate_size=p["intermediate_size"], num_hidden_layers=p["num_layers"],
                         num_attention_heads=p["num_heads"], num_key_value_heads=p.get("num_kv_heads", p["num_heads"]),
                         max_position_embeddings=4096, pad_token_id=0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(hf_cfg).to(torch.bfloat16).eval()
    ids = torch.arange(10, 10 + prompt_len, device="cuda").repeat(batch, 1)
    mask = torch.ones_like(ids)

    def generate(m, **kw):
        return m.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                          do_sample=False, **kw)

    def timed(m, warm_up_full: bool = False, **kw) -> float:
        if warm_up_full:  # the compiled static-cache path: compile for these very shapes first
            generate(m, **kw)
        else:
            m.generate(ids[:, :8], attention_mask=mask[:, :8], max_new_tokens=4, do_sample=False, **kw)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = generate(m, **kw)
        torch.cuda.synchronize()
        return (out.shape[1] - prompt_len) * batch / (time.perf_counter() - t0)

    with torch.inference_mode():
        base = timed(model)
        static = timed(model, warm_up_full=True, cache_implementation="static")
    lora = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(PROJ), init_lora_weights=False)
    peft_model = get_peft_model(model, lora, adapter_name="a0")
    for i in range(1, n_adapters):
        peft_model.add_adapter(f"a{i}", lora)
    peft_model.to(torch.bfloat16).eval()
    names = [f"a{i % n_adapters}" for i in range(batch)]
    with torch.inference_mode():
        mixed = timed(peft_model, adapter_names=names)
    del peft_model, model
    gc.collect()
    torch.cuda.empty_cache()
    return base, static, mixed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="llama-7b", help="dummy preset (inference_server/model/dummy.py)")
    ap.add_argument("--num-requests", type=int, default=1000)
    ap.add_argument("--max-len", type=int, default=2048)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--kv-fraction", type=float, default=0.5,
                    help="the engine's kv_cache_memory_fraction: the KV cache's share of what the weights, the "
                         "measured step reserve and the adapter pool leave (engine/memory_plan.py)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--max-lora-rank", type=int, default=None,
                    help="the engine's rank cap (default: --rank; the server's default is 128)")
    ap.add_argument("--num-adapters", type=int, default=64)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--hf-new-tokens", type=int, default=128, help="0 = skip the transformers + PEFT batch")
    ap.add_argument("--hf-adapters", type=int, default=4)
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (for comparison)")
    ap.add_argument("--lora-side-stream", choices=("on", "off"), default="on",
                    help="in step graphs, LoRA shrinks beside the base GEMMs (off: one stream, for comparison)")
    ap.add_argument("--launch-ahead", choices=("on", "off", "both"), default="on",
                    help="launch each step before reading the previous one's tokens; both: every workload "
                         "twice, on then off (same engine, for an A/B in one run)")
    ap.add_argument("--lora-decode-rows", type=int, default=None,
                    help="LoRA calls of up to this many rows take the decode kernels (default: the kernels' "
                         "SMALL_BATCH_ROWS, 512, the largest graph); past it the prefill kernels, one 128-row tile "
                         "a segment. Steps that admit prompts beside a full batch of 256 reach graphs of 257-512 rows")
    ap.add_argument("--admission-headroom", default=None,
                    help="admission headroom tokens (the engine's default when not given); a comma-separated "
                         "list runs each workload once per value, on the same engine (scheduler.py)")
    ap.add_argument("--sampled-share", type=float, default=0.0,
                    help="the share of requests that sample (temperature 0.8, top-p 0.95, seeded); the rest greedy")
    ap.add_argument("--sampled-penalty", type=float, default=1.0,
                    help="the sampled requests' repetition penalty (1 = none)")
    ap.add_argument("--prefill-attention", default="varlen",
                    help="eager steps' prompt chunks: varlen (one flash call a layer), per-span (one SDPA call a "
                         "span), or both comma-separated: each workload once per value, on the same engine")
    ap.add_argument("--profile-eager", type=int, default=0,
                    help="profile this many eager steps (more rows than the largest graph, over at least half the "
                         "max batch) and print where their host and device time goes "
                         "(benchmarks/engine/eager_profile.py)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--results", type=Path, default=None)
    ap.add_argument("--parts-dir", type=Path, default=None,
                    help="keep each workload's row (and the fixed batch) there, and build the table from every "
                         "part there: runs made back to back add up to one table (benchmarks/engine/textgen_parts.py)")
    args = ap.parse_args()
    workloads = [w for w in args.workloads.split(",") if w]  # "" = none: only the fixed batch
    unknown = sorted(set(workloads) - set(WORKLOADS))
    if unknown:
        ap.error(f"--workloads: unknown {', '.join(unknown)} (known: {', '.join(WORKLOADS)})")
    command = "python -m benchmarks.engine.bench_textgen " + " ".join(sys.argv[1:])

    hf = None
    if args.hf_new_tokens:
        hf = fixed_batch_hf(args.model, args.rank, args.max_batch, 128, args.hf_new_tokens, args.hf_adapters)
        print(f"transformers: base {hf[0]:.0f} tok/s, base with a static cache (compiled) {hf[1]:.0f} tok/s, "
              f"+ PEFT ({args.hf_adapters} adapters mixed) {hf[2]:.0f} tok/s", flush=True)
    bandwidth = measure_copy_bandwidth()  # before the engine takes the memory it sizes its caches from
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s (the roofline's)", flush=True)
    torch.cuda.empty_cache()
    if args.lora_decode_rows:  # before the graphs are captured: each call's path is fixed then
        from loraplex.kernels.cuda import _plan  # noqa: PLC0415

        _plan.SMALL_BATCH_ROWS = args.lora_decode_rows
        print(f"LoRA decode kernels up to {args.lora_decode_rows} rows", flush=True)
    engine = build_engine(args)
    log = StepLog()
    rearm_profile = (wrap_eager_steps(engine._core.runner, args.profile_eager, args.max_batch // 2)
                     if args.profile_eager else None)
    instrument(engine, log)
    reqs = request_set(args.num_requests, args.max_len, args.seed)
    vocab = engine._core.runner.config.vocab_size
    rows = []
    modes = {"on": (True,), "off": (False,), "both": (True, False)}[args.launch_ahead]
    scheduler = engine._core.scheduler
    print(f"KV cache: {engine._core.blocks.num_blocks} blocks of {engine._core.blocks.block_size} tokens", flush=True)
    headrooms = ([int(h) for h in args.admission_headroom.split(",")] if args.admission_headroom
                 else [scheduler.config.admission_headroom_tokens])
    prefill_paths = args.prefill_attention.split(",")
    if set(prefill_paths) - {"varlen", "per-span"}:
        ap.error(f"--prefill-attention: varlen and/or per-span, got {args.prefill_attention!r}")
    runs = ((w, a, h, p) for w in workloads for a in modes for h in headrooms for p in prefill_paths)
    for workload, ahead, headroom, prefill_path in runs:
        attention.VARLEN_PREFILL = prefill_path == "varlen"
        engine._core._launch_ahead = ahead and engine._core.runner.can_launch
        scheduler.config = dataclasses.replace(scheduler.config, admission_headroom_tokens=headroom)
        preempted = engine._core.num_preemptions
        if rearm_profile:
            rearm_profile()
        ids = adapter_ids(workload, len(reqs), args.max_batch, args.num_adapters, args.seed)
        r = run_workload(engine, reqs, ids, vocab, args.seed, log, args.sampled_share, args.sampled_penalty)
        r["preemptions"] = engine._core.num_preemptions - preempted
        distinct = len({a for a in ids[: args.max_batch] if a}) if workload != "base" else 0
        roof, roof_lora = roofline_ms(engine, r["full_ctx"], distinct, args.rank, bandwidth)
        label = workload if ahead or args.launch_ahead == "off" else f"{workload} (no launch-ahead)"
        if len(headrooms) > 1:
            label += f" (headroom {headroom})"
        if len(prefill_paths) > 1:
            label += f" ({prefill_path})"
        if args.sampled_share:
            label += f" ({args.sampled_share:.0%} sampled" + (
                f", repetition penalty {args.sampled_penalty})" if args.sampled_penalty != 1.0 else ")")
        r.update(workload=label, roof=roof, roof_lora=roof_lora)
        rows.append(r)
        if args.parts_dir:
            textgen_parts.save_row(args.parts_dir, r, command)
        print(f"{label:9s} {r['throughput']:8.0f} tok/s  generated {r['decode_tps']:7.0f} tok/s  "
              f"tpot p50/p99 {r['tpot_p50']:.2f}/{r['tpot_p99']:.2f} ms  ttft p50 {r['ttft_p50']:.1f} s  "
              f"preemptions {r['preemptions']}  slow steps {r['slow_steps']}/{r['steps']}  "
              f"step@{r['full_batch']} {r['full_step_ms']:.2f} ms (roofline {roof:.2f} ms, x{r['full_step_ms'] / roof:.2f})",
              flush=True)
        print(f"{'':9s} wall {r['wall']:.1f} s, outside engine steps {r['outside_steps']:.2f} s; slowest steps "
              + ", ".join(f"{s * 1e3:.0f} ms ({n} seqs, {t} tokens)" for s, n, t, _ in r["slowest"]), flush=True)
    fixed = None
    if args.hf_new_tokens:
        fixed = dict(new_tokens=args.hf_new_tokens, adapters=args.hf_adapters, hf=list(hf), loraplex={})
        for name, ids in ((f"{args.hf_adapters} adapters mixed", [f"a{i % args.hf_adapters}" for i in range(args.max_batch)]),
                          (f"{args.max_batch} distinct adapters", [f"a{i}" for i in range(args.max_batch)]),
                          ("base model", [None] * args.max_batch)):
            fixed["loraplex"][name] = fixed_batch_loraplex(engine, ids, args.hf_new_tokens, 128)
            print(f"loraplex fixed batch, {name}: {fixed['loraplex'][name]:.0f} tok/s", flush=True)
        if args.parts_dir:
            textgen_parts.save_fixed(args.parts_dir, fixed, command)
    notes = ""
    if args.parts_dir:
        parts = textgen_parts.load(args.parts_dir, WORKLOADS)
        rows, fixed, command = parts.rows, parts.fixed, " ; ".join(parts.commands)
        notes = f"Built from {len(parts.commands)} run(s)' parts on: {'; '.join(parts.hosts)}."
    lines = table(rows, args.max_batch, fixed)
    print("\n".join(lines + ([notes] if notes else [])))
    if args.results:
        title = (f"Text generation (Punica workload), {args.model} dummy bf16, rank {args.rank}, "
                 f"{args.num_requests} requests, max batch {args.max_batch}")
        record_results(args.results, title, command, lines, notes)


def table(rows: list[dict], max_batch: int, fixed: dict | None) -> list[str]:
    """The markdown table of the workloads (against base, when a base row is there) and of the
    fixed batch (``fixed``: new_tokens, adapters, hf [base, base with a static cache, mixed] or,
    from parts saved before the static cache was timed, [base, mixed]; loraplex {name: tokens/s})."""
    base = next((r for r in rows if r["workload"].split(" (")[0] == "base"), None)
    lines = ["| workload | tokens/s | generated tok/s | vs base | per-token p50 / p99 (ms) | TTFT p50 / p99 (s) "
             f"| decode step at batch {max_batch} (ms) | roofline weights+KV (ms) | step / roofline "
             "| roofline + adapters (ms) | preemptions |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        rel = f"{r['throughput'] / base['throughput'] - 1:+.1%}" if base else "-"
        lines.append(
            f"| {r['workload']} | {r['throughput']:.0f} | {r['decode_tps']:.0f} | {rel} | {r['tpot_p50']:.2f} / "
            f"{r['tpot_p99']:.2f} | {r['ttft_p50']:.1f} / {r['ttft_p99']:.1f} | {r['full_step_ms']:.2f} | "
            f"{r['roof']:.2f} | {r['full_step_ms'] / r['roof']:.2f}x | {r['roof_lora']:.2f} | "
            f"{r.get('preemptions', '-')} |")
    if fixed:
        hf = fixed["hf"]
        hf_base, hf_static, hf_mixed = hf if len(hf) == 3 else (hf[0], None, hf[1])
        lines += ["", f"Fixed batch: {max_batch} requests x 128 prompt + {fixed['new_tokens']} new tokens "
                      "(generated tokens/s):", "", "| system | tokens/s |", "| --- | ---: |",
                  f"| transformers, base model | {hf_base:.0f} |"]
        if hf_static is not None:
            lines.append(f"| transformers, base model, static cache (generate compiles it) | {hf_static:.0f} |")
        lines.append(f"| transformers + PEFT, {fixed['adapters']} adapters mixed (adapter_names) | {hf_mixed:.0f} |")
        lines += [f"| loraplex, {name} | {v:.0f} |" for name, v in fixed["loraplex"].items()]
        distinct = fixed["loraplex"].get(f"{max_batch} distinct adapters")
        if hf_static and distinct:
            lines += ["", f"loraplex with {max_batch} distinct adapters against transformers' compiled static cache "
                          f"(base model): {distinct / hf_static:.2f}x"]
    return lines


if __name__ == "__main__":
    main()
