"""bench_open_loop.py's markdown: one row per (prefix cache, edge, workload, adapters, rate), each
workload's overhead against the base model at the same rate, and the failures by reason."""

from __future__ import annotations

import math
from dataclasses import dataclass

from benchmarks.serving.open_loop_metrics import Summary


@dataclass(frozen=True, slots=True)
class RunKey:
    """What one run varied; ``adapters`` is 0 for the base model."""

    prefix_caching: str
    edge: str
    workload: str
    adapters: int
    rate: float

    def label(self) -> str:
        n = f" N={self.adapters}" if self.workload != "base" else ""
        return f"{self.edge} {self.workload}{n} @ {rate_label(self.rate)} req/s (prefix cache {self.prefix_caching})"


def rate_label(rate: float) -> str:
    return "inf" if math.isinf(rate) else f"{rate:g}"


def _ms(seconds: float) -> str:
    return "n/a" if math.isnan(seconds) else f"{1e3 * seconds:.1f}"


def _pct(value: float, base: float) -> str:
    if math.isnan(value) or math.isnan(base) or base == 0:
        return "n/a"
    return f"{100 * (value / base - 1):+.1f}%"


def base_of(key: RunKey, runs: dict[RunKey, Summary]) -> Summary | None:
    """The base model's run at the same prefix-cache setting, edge and rate, if there is one."""
    return next((s for k, s in runs.items() if k.workload == "base" and (k.prefix_caching, k.edge, k.rate)
                 == (key.prefix_caching, key.edge, key.rate)), None)


HEAD = ["edge", "workload", "adapters", "rate (req/s)", "done / sent", "req/s", "out tok/s",
        "TTFT p50 / p99 (ms)", "TPOT p50 / p99 (ms)", "ITL p99 (ms)", "goodput (req/s)",
        "out tok/s vs base", "TPOT p50 vs base"]


def row(key: RunKey, s: Summary, base: Summary | None, with_prefix: bool, hit: float = math.nan) -> str:
    vs = ("-", "-") if base is None or key.workload == "base" else (
        _pct(s.output_tok_per_s, base.output_tok_per_s), _pct(s.tpot_p50, base.tpot_p50))
    cells = [key.edge, key.workload, str(key.adapters) if key.workload != "base" else "-", rate_label(key.rate),
             f"{s.completed} / {s.sent}", f"{s.req_per_s:.2f}", f"{s.output_tok_per_s:.0f}",
             f"{_ms(s.ttft_p50)} / {_ms(s.ttft_p99)}", f"{_ms(s.tpot_p50)} / {_ms(s.tpot_p99)}", _ms(s.itl_p99),
             f"{s.goodput:.2f}", *vs]
    if with_prefix:
        cells = [key.prefix_caching, *cells, "n/a" if math.isnan(hit) else f"{100 * hit:.0f}%"]
    return "| " + " | ".join(cells) + " |"


def table(runs: dict[RunKey, Summary], with_prefix: bool, hits: dict[RunKey, float] | None = None) -> list[str]:
    """The markdown table of ``runs`` (in their order); with ``with_prefix``, a prefix-cache column
    and the share of prompt tokens the prefix cache served (``hits``, from the server's counters)."""
    head = ["prefix cache", *HEAD, "prompt tokens from cache"] if with_prefix else HEAD
    lines = ["| " + " | ".join(head) + " |",
             "| " + " | ".join("---" if h in ("edge", "workload", "prefix cache") else "---:" for h in head) + " |"]
    lines += [row(k, s, base_of(k, runs), with_prefix, (hits or {}).get(k, math.nan)) for k, s in runs.items()]
    return lines


def failures(runs: dict[RunKey, Summary]) -> list[str]:
    """One line per run with failed requests: how many and why."""
    return [f"- {k.label()}: {s.failed} of {s.sent} failed ("
            + ", ".join(f"{why} x{n}" for why, n in sorted(s.errors.items())) + ")"
            for k, s in runs.items() if s.failed]
