"""bench_open_loop.py's command line: what to sweep, the server's flags, the request stream's shape."""

from __future__ import annotations

import argparse
import math
import os
import re

from benchmarks.serving.open_loop_clients import EDGES
from benchmarks.serving.open_loop_workload import WORKLOADS

_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def byte_size(text: str) -> int:
    """'268435456', '256MiB', '4GiB', '1.5G' -> bytes."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", text)
    unit = m.group(2).lower().removesuffix("b") if m else ""
    unit = {"ki": "kib", "mi": "mib", "gi": "gib"}.get(unit, unit)
    if m is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 268435456, 256MiB, 4GiB)")
    return int(float(m.group(1)) * _UNITS[unit])


def _list(parse):  # noqa: ANN001, ANN202
    def split(text: str) -> list:
        try:
            return [parse(part) for part in text.split(",") if part.strip()]
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"{text!r}: {exc}") from None
    return split


def _rate(text: str) -> float:
    rate = float(text)
    if not rate > 0:
        raise ValueError(f"a rate must be > 0 requests/s or inf, got {text}")
    return rate


def _choice(choices: tuple[str, ...]):  # noqa: ANN202
    def check(text: str) -> str:
        if text not in choices:
            raise ValueError(f"{text!r} is not one of {', '.join(choices)}")
        return text
    return check


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="bench_open_loop.py", description="Open-loop serving benchmark (Poisson "
                                 "arrivals, rate sweep) against a real loraplex-server on a dummy model.")
    srv = ap.add_argument_group("server")
    srv.add_argument("--model", default="tiny", help="dummy preset: tiny, smollm2-135m, llama-7b")
    srv.add_argument("--device", default="cpu")
    srv.add_argument("--dtype", default="float32", help="float32, bfloat16, float16 (adapters are written in it)")
    srv.add_argument("--max-num-seqs", type=int, default=None, help="batch size (server default if unset)")
    srv.add_argument("--max-num-batched-tokens", type=int, default=None)
    srv.add_argument("--num-kv-blocks", type=int, default=None)
    srv.add_argument("--max-waiting", type=int, default=None)
    srv.add_argument("--adapter-pool-bytes", type=byte_size, default=None, help="e.g. 4GiB (server default if unset)")
    srv.add_argument("--adapter-host-cache-bytes", type=byte_size, default=None,
                     help="the server's pinned host tier (passed only when given)")
    srv.add_argument("--max-lora-rank", type=int, default=None)
    srv.add_argument("--prefix-caching", type=_list(_choice(("on", "off"))), default=["on"],
                     help="on, off or on,off (a server for each)")
    srv.add_argument("--server-arg", action="append", default=[], help="more server flags, e.g. '--cuda-graphs off'")
    srv.add_argument("--one-server", action="store_true", help="every adapter count on one server storing "
                     "max(N) adapters, each count drawing over its own random subset (saves server starts)")
    load = ap.add_argument_group("load")
    load.add_argument("--edge", choices=("grpc", "http", "both"), default="grpc")
    load.add_argument("--workload", type=_list(_choice(WORKLOADS)), default=["distinct", "uniform", "skewed", "base"])
    load.add_argument("--num-adapters", type=_list(int), default=[64], help="e.g. 5,100,1000,2000")
    load.add_argument("--ranks", type=_list(int), default=[16], help="e.g. 16 or 8,16,32,64 (adapter i: i-th mod)")
    load.add_argument("--distinct-weight-files", type=int, default=None,
                      help="K: the adapter folders hard-link K weight files per rank (default: one each)")
    load.add_argument("--rates", type=_list(_rate), default=[1.0, 2.0, 4.0, math.inf], help="req/s; inf = at once")
    load.add_argument("--num-requests", type=int, default=200, help="per rate (and for rate inf with --duration)")
    load.add_argument("--duration", type=float, default=None, help="seconds of arrivals per rate instead")
    load.add_argument("--prompt-mean", type=float, default=224.0)
    load.add_argument("--prompt-sigma", type=float, default=1.0)
    load.add_argument("--max-prompt-len", type=int, default=1024)
    load.add_argument("--output-mean", type=float, default=198.0)
    load.add_argument("--output-sigma", type=float, default=0.8)
    load.add_argument("--max-output-len", type=int, default=1024)
    load.add_argument("--shared-prefix-len", type=int, default=0, help="system prompt tokens shared per adapter")
    load.add_argument("--zipf-alpha", type=float, default=1.5, help="skewed workload's exponent")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="1: Poisson arrivals; b: gamma gaps of shape b, same mean (b < 1: bursts and lulls)")
    load.add_argument("--constrained-fraction", type=float, default=0.0,
                      help="share of requests sent with a JSON schema (structured output; open_loop_clients.py)")
    load.add_argument("--n", type=int, default=1,
                      help="choices per request (OpenAI's n: the choices share the prompt's KV blocks); a request's "
                           "tokens count over all its choices")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--client-procs", type=int, default=max(1, min(4, (os.cpu_count() or 1) // 4)))
    load.add_argument("--warmup", type=int, default=None,
                      help="unreported 8-token requests per edge after each start, round robin over the stored "
                           "adapters (default: one per stored adapter, at least 8, at most 64)")
    load.add_argument("--request-timeout", type=float, default=600.0)
    out = ap.add_argument_group("report")
    out.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    out.add_argument("--slo-tpot-ms", type=float, default=50.0)
    out.add_argument("--results", default=None, help="record the table in this RESULTS.md (benchmarks/common/results.py)")
    out.add_argument("--workdir", default=None, help="where the adapters and server logs go (a temporary folder)")
    return ap


def check(ap: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.Namespace:
    """Cross-option checks, as argparse errors a user can act on; adds ``args.edges``."""
    from loraplex.inference_server.model.dummy import preset_config

    try:
        context = preset_config(args.model).max_position_embeddings
    except ValueError as exc:
        ap.error(str(exc))
    longest = args.shared_prefix_len + args.max_prompt_len + args.max_output_len
    if longest > context:
        ap.error(f"--shared-prefix-len + --max-prompt-len + --max-output-len = {longest} exceeds the "
                 f"{args.model} preset's context of {context} tokens")
    if min(args.num_adapters, default=0) < 1 or min(args.ranks, default=0) < 1:
        ap.error("--num-adapters and --ranks need values >= 1")
    if args.distinct_weight_files is not None and args.distinct_weight_files < 1:
        ap.error("--distinct-weight-files must be >= 1")
    if args.num_requests < 1 or (args.duration is not None and args.duration <= 0):
        ap.error("--num-requests must be >= 1 and --duration > 0")
    if not (args.burstiness > 0 and math.isfinite(args.burstiness)):
        ap.error(f"--burstiness must be a finite number > 0 (1: Poisson arrivals), got {args.burstiness:g}")
    if args.n < 1:
        ap.error(f"--n must be >= 1, got {args.n}")
    if not 0.0 <= args.constrained_fraction <= 1.0:
        ap.error(f"--constrained-fraction must be in [0, 1], got {args.constrained_fraction:g}")
    args.edges = list(EDGES) if args.edge == "both" else [args.edge]
    return args


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = build_parser()
    return check(ap, ap.parse_args(argv))
