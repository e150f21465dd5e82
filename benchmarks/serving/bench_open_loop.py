"""Open-loop serving benchmark (as ``vllm bench serve`` measures): Poisson arrivals at a sweep of
rates against a real ``loraplex-server`` process on a dummy model, through gRPC and/or HTTP.

Per (prefix cache, edge, workload, number of adapters, rate): completed requests, request and
output-token throughput, TTFT and TPOT p50/p99, ITL p99, goodput under an SLO, and each adapter
workload's overhead against the base model at the same rate. The request stream (ShareGPT-like
lengths, adapter draws, shared system prompts) is open_loop_workload.py's; the clients
open_loop_clients.py's; the figures open_loop_metrics.py's.

    python -m benchmarks.serving.bench_open_loop --model tiny --rates 2,inf --num-requests 20 --edge both \
        --prompt-mean 32 --output-mean 16 --max-prompt-len 128 --max-output-len 64
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path


from benchmarks.serving.open_loop_args import parse_args
from benchmarks.serving.adapter_folders import adapter_names, link_subset, write_adapters
from benchmarks.serving.open_loop_clients import ClientPool, Endpoint
from benchmarks.serving.open_loop_metrics import RequestRecord, Slo, Summary, summarize
from benchmarks.common.server import prefix_cache_tokens, start_server
from benchmarks.serving.open_loop_report import RunKey, failures, rate_label, table
from benchmarks.serving.open_loop_workload import BenchRequest, LengthDist, WorkloadSpec, build_requests


@dataclass(frozen=True, slots=True)
class RunResult:
    key: RunKey
    requests: list[BenchRequest]
    records: list[RequestRecord]
    summary: Summary
    prefix_hit: float  # share of the run's prompt tokens served from the prefix cache (NaN: none looked up)


def server_flags(args: argparse.Namespace, adapter_dir: Path, prefix_caching: str) -> list[str]:
    """The server's flags: the dummy model, the engine limits asked for, the adapters' folder."""
    flags = ["--model-format", "dummy", "--model", args.model, "--device", args.device, "--dtype", args.dtype,
             "--adapter-dir", str(adapter_dir), "--prefix-caching", prefix_caching, "--log-level", "WARNING"]
    for name in ("max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "adapter_pool_bytes",
                 "adapter_host_cache_bytes", "max_lora_rank", "max_waiting"):
        if getattr(args, name) is not None:  # only flags given: the server may not know them all yet
            flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return flags + [f for extra in args.server_arg for f in extra.split()]


def spec_for(args: argparse.Namespace, workload: str, adapters: tuple[str, ...], rate: float, salt: int,
             vocab_size: int) -> WorkloadSpec:
    n = args.num_requests if args.duration is None or math.isinf(rate) else max(1, round(rate * args.duration))
    return WorkloadSpec(workload=workload, adapters=adapters if workload != "base" else (), rate=rate,
                        num_requests=n, vocab_size=vocab_size,
                        prompt=LengthDist(args.prompt_mean, args.prompt_sigma, args.max_prompt_len),
                        output=LengthDist(args.output_mean, args.output_sigma, args.max_output_len),
                        shared_prefix_len=args.shared_prefix_len, zipf_alpha=args.zipf_alpha,
                        burstiness=args.burstiness, seed=args.seed, salt=salt,
                        constrained_fraction=args.constrained_fraction, choices=args.n)


def count_subsets(args: argparse.Namespace, counts: list[int], names: list[str]) -> dict[int, tuple[str, ...]]:
    """Each count's adapters: all the server stores, or (--one-server) a seeded random subset."""
    import numpy as np

    if not args.one_server:
        return {n: tuple(names[:n]) for n in counts}
    rng = np.random.default_rng([args.seed, 5])
    return {n: tuple(names[i] for i in sorted(rng.permutation(len(names))[:n])) for n in counts}


def plans(args: argparse.Namespace) -> list[tuple[str, list[int]]]:
    """(prefix caching, the adapter counts one server runs) for each server to start."""
    counts = args.num_adapters if any(w != "base" for w in args.workload) else [0]
    groups = [counts] if args.one_server else [[n] for n in counts]
    return [(p, g) for p in args.prefix_caching for g in groups]


class Bench:
    """Runs every planned server and run; keeps the results in order."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        from loraplex.inference_server.model.dummy import preset_config

        self.args, self.workdir = args, workdir
        self.vocab_size = preset_config(args.model).vocab_size
        self.slo = Slo(args.slo_ttft_ms / 1e3, args.slo_tpot_ms / 1e3)
        self.salts = itertools.count(1)
        self.began = time.perf_counter()
        self.results: list[RunResult] = []
        self.names = adapter_names(max(args.num_adapters)) if any(w != "base" for w in args.workload) else []

    def write_adapters(self) -> None:
        if self.names:
            dtype = self.args.dtype if self.args.dtype in ("float16", "bfloat16") else "float32"
            write_adapters(self.args.model, self.workdir / "adapters", self.names, self.args.ranks, dtype,
                           self.args.distinct_weight_files, self.args.seed)
            files = self.args.distinct_weight_files
            self.say(f"{len(self.names)} adapters written" + (
                f" (their folders hard-link {files} distinct weight files per rank: each id is still fetched, "
                "validated, staged and placed on its own)" if files else ""))

    def run_all(self, pool: ClientPool) -> list[RunResult]:
        self.write_adapters()
        based: set[str] = set()
        for i, (prefix, counts) in enumerate(plans(self.args)):
            stored = self.names[:max(counts)]
            folder = link_subset(self.workdir / "adapters", stored, self.workdir / f"server-{i}")
            started = time.perf_counter()
            server = start_server(server_flags(self.args, folder, prefix), self.workdir / f"server-{i}.log")
            self.say(f"server {i + 1} (prefix cache {prefix}, {len(stored)} adapters stored) serving after "
                     f"{time.perf_counter() - started:.0f} s")
            try:
                endpoint = Endpoint(server.grpc_address, server.http_port, server.base_model)
                self.warm_up(pool, endpoint, tuple(stored))
                self.run_server(pool, endpoint, prefix, count_subsets(self.args, counts, stored),
                                with_base=prefix not in based)
                based.add(prefix)
            finally:
                server.stop()
        return self.results

    def warm_up(self, pool: ClientPool, endpoint: Endpoint, adapters: tuple[str, ...]) -> None:
        """Unreported requests of 8 tokens at once over each edge, round robin over the stored
        adapters (connections, first steps, and each of the first ``warmup`` adapters loaded once,
        so that the first measured run does not pay every cold load alone)."""
        count = self.args.warmup if self.args.warmup is not None else min(64, max(8, len(adapters)))
        if count:
            spec = spec_for(self.args, "distinct" if adapters else "base", adapters, math.inf, 0, self.vocab_size)
            spec = replace(spec, num_requests=count, output=LengthDist(8, 0.0, 8))
            for edge in self.args.edges:
                pool.run(edge, endpoint, build_requests(spec), timeout_s=self.args.request_timeout)
            self.say(f"warmed up: {count} requests per edge")

    def run_server(self, pool: ClientPool, endpoint: Endpoint, prefix: str, subsets: dict[int, tuple[str, ...]],
                   with_base: bool) -> None:
        for edge, (n, adapters), workload in itertools.product(self.args.edges, subsets.items(), self.args.workload):
            if workload == "base" and (not with_base or n != next(iter(subsets))):
                continue  # the base model once per prefix-cache setting and edge
            for rate in self.args.rates:
                spec = spec_for(self.args, workload, adapters, rate, next(self.salts), self.vocab_size)
                self.run_one(pool, endpoint, RunKey(prefix, edge, workload, n if workload != "base" else 0, rate),
                             spec)

    def run_one(self, pool: ClientPool, endpoint: Endpoint, key: RunKey, spec: WorkloadSpec) -> None:
        requests = build_requests(spec)
        queried, hit = prefix_cache_tokens(endpoint.http_port)
        records = pool.run(key.edge, endpoint, requests, timeout_s=self.args.request_timeout)
        summary = summarize(records, self.slo)
        queried_after, hit_after = prefix_cache_tokens(endpoint.http_port)
        share = (hit_after - hit) / (queried_after - queried) if queried_after > queried else math.nan
        self.results.append(RunResult(key, requests, records, summary, share))
        self.say(f"{key.label()}: {summary.completed}/{summary.sent} done, {summary.req_per_s:.2f} req/s, "
                 f"{summary.output_tok_per_s:.0f} out tok/s, TTFT p50 {1e3 * summary.ttft_p50:.1f} ms, "
                 f"TPOT p50 {1e3 * summary.tpot_p50:.1f} ms")

    def say(self, line: str) -> None:
        print(f"[{time.perf_counter() - self.began:6.1f} s] {line}", flush=True)


SERVER_NOTED = ("max_num_seqs", "adapter_pool_bytes", "adapter_host_cache_bytes", "max_lora_rank", "num_kv_blocks")


def notes(args: argparse.Namespace, runs: dict[RunKey, Summary]) -> str:
    """What the table does not say: the distributions, SLO, adapters, server, clients, failures."""
    per_rate = f"{args.num_requests} requests" if args.duration is None else f"{args.duration:g} s of arrivals"
    flags = [f"--{n.replace('_', '-')} {getattr(args, n)}" for n in SERVER_NOTED if getattr(args, n) is not None]
    sentences = [
        f"Prompt lengths log-normal, mean {args.prompt_mean:g}, sigma {args.prompt_sigma:g}, in [4, "
        f"{args.max_prompt_len}]; output lengths mean {args.output_mean:g}, sigma {args.output_sigma:g}, in [4, "
        f"{args.max_output_len}] (ignore_eos: exactly that many).",
        ("Poisson arrivals" if args.burstiness == 1 else f"Gamma arrivals of burstiness {args.burstiness:g} (gaps' "
         f"coefficient of variation {args.burstiness ** -0.5:.2f})") + f", seed {args.seed}, {per_rate} per rate.",
        f"Shared system prompt of {args.shared_prefix_len} tokens per adapter." if args.shared_prefix_len else "",
        f"Goodput SLO: TTFT <= {args.slo_ttft_ms:g} ms and TPOT <= {args.slo_tpot_ms:g} ms.",
        f"{args.constrained_fraction:.0%} of requests constrained to a JSON schema (an array of digits, at least "
        "4096: it runs to its length too)." if args.constrained_fraction else "",
        f"Skewed: Zipf alpha {args.zipf_alpha:g}." if "skewed" in args.workload else "",
        f"n = {args.n} choices per request (tokens count over all of them)." if args.n > 1 else "",
        f"Ranks {','.join(map(str, args.ranks))}.",
        f"Server flags: {', '.join(flags) or 'the defaults'}; {args.client_procs} client processes;",
        "one server for every adapter count (each count a random subset of the stored adapters)." if args.one_server
        else "a fresh server per adapter count, storing exactly that many.",
    ]
    lines = [" ".join(s for s in sentences if s)]
    if args.distinct_weight_files:
        lines.append(f"The adapter folders hard-link {args.distinct_weight_files} distinct weight files per rank: "
                     "each id is still fetched, validated, staged and placed on its own; only the values repeat.")
    return "\n".join(lines + failures(runs))


def title(args: argparse.Namespace) -> str:
    adapters = f"{','.join(map(str, args.num_adapters))} adapters rank {','.join(map(str, args.ranks))}"
    return (f"Open-loop serving (bench_serve): dummy {args.model} {args.dtype} on {args.device}, "
            f"{'+'.join(args.edges)}, {','.join(args.workload)}, {adapters}, rates "
            f"{','.join(rate_label(r) for r in args.rates)}"
            + (f", shared prefix {args.shared_prefix_len}" if args.shared_prefix_len else "")
            + (f", {args.constrained_fraction:.0%} constrained" if args.constrained_fraction else "")
            + (f", n={args.n}" if args.n > 1 else "")
            + f", prefix cache {'/'.join(args.prefix_caching)}")


def main(argv: list[str] | None = None) -> list[RunResult]:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="bench-serve-", dir=args.workdir) as tmp:
        pool = ClientPool(args.client_procs)
        try:
            results = Bench(args, Path(tmp)).run_all(pool)
        finally:
            pool.close()
    runs = {r.key: r.summary for r in results}
    lines = table(runs, len(args.prefix_caching) > 1 or args.shared_prefix_len > 0,
                  {r.key: r.prefix_hit for r in results})
    print("\n".join(["", f"## {title(args)}", "", *lines, "", notes(args, runs)]))
    if args.results:
        from benchmarks.common.results import record_results

        command = "python -m benchmarks.serving.bench_open_loop " + " ".join(argv if argv is not None else sys.argv[1:])
        record_results(Path(args.results), title(args), command, lines, notes(args, runs))
    return results


if __name__ == "__main__":
    main()
