"""Per-request timestamps -> the figures bench_open_loop.py reports (as ``vllm bench serve`` defines them).

- TTFT: first streamed message's arrival - send time.
- TPOT: (last message's arrival - first message's arrival) / (output tokens - 1), per request;
  a one-token request has none (and meets any TPOT objective).
- ITL: the gaps between consecutive messages of a request (a message may carry several tokens).
- Throughput: completed requests and their output tokens / the run's duration, from the first
  send to the last answer (failed requests' end included).
- Goodput: completed requests per second meeting both objectives (TTFT <= slo_ttft_s and
  TPOT <= slo_tpot_s), over the same duration.

A request fails on any error status or when it streamed other than exactly its drawn number of
tokens; failures are counted and named, never dropped.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np


@dataclass(slots=True)
class RequestRecord:
    """What a client saw of one request: times are time.perf_counter() seconds (one clock for
    every process on Linux: CLOCK_MONOTONIC)."""

    index: int
    adapter: str | None
    prompt_len: int
    expected_tokens: int
    sent: float
    arrivals: list[float] = field(default_factory=list)  # one per streamed message with tokens
    tokens: int = 0  # output tokens the server reported (usage) or streamed
    error: str | None = None  # why it failed; None when it completed
    done: float = 0.0  # when the answer (or the error) ended
    choices: int = 1  # OpenAI's n: tokens count over all choices, which stream side by side

    def fail_if_short(self) -> None:
        """Mark a request that ended without error but with the wrong token count as failed."""
        if self.error is None and (self.tokens != self.expected_tokens or not self.arrivals):
            self.error = f"streamed {self.tokens} of {self.expected_tokens} tokens"

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float:
        return self.arrivals[0] - self.sent

    @property
    def tpot(self) -> float | None:
        """Time per output token of one choice (the choices of a request decode side by side)."""
        per_choice = self.tokens / self.choices
        if per_choice < 2:
            return None
        return (self.arrivals[-1] - self.arrivals[0]) / (per_choice - 1)

    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.arrivals, self.arrivals[1:])]


@dataclass(frozen=True, slots=True)
class Slo:
    """The service-level objectives of goodput (seconds)."""

    ttft_s: float = 1.0
    tpot_s: float = 0.050

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tpot_s <= 0:
            raise ValueError(f"SLO bounds must be > 0 s, got TTFT {self.ttft_s}, TPOT {self.tpot_s}")

    def met(self, record: RequestRecord) -> bool:
        tpot = record.tpot
        return record.ok and record.ttft <= self.ttft_s and (tpot is None or tpot <= self.tpot_s)


@dataclass(frozen=True, slots=True)
class Summary:
    """One run's figures (times in seconds; NaN where no completed request measured it)."""

    sent: int
    completed: int
    failed: int
    errors: dict[str, int]
    duration_s: float
    req_per_s: float
    output_tok_per_s: float
    ttft_p50: float
    ttft_p99: float
    tpot_p50: float
    tpot_p99: float
    itl_p99: float
    goodput: float


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100, linear interpolation as numpy's); NaN of nothing."""
    return float(np.percentile(values, q)) if values else float("nan")


def summarize(records: list[RequestRecord], slo: Slo) -> Summary:
    """The run's figures from every request's record (module docstring)."""
    if not records:
        raise ValueError("no requests to summarize")
    good = [r for r in records if r.ok]
    start = min(r.sent for r in records)
    duration = max(max(r.done for r in records) - start, 1e-9)
    ttfts = [r.ttft for r in good]
    tpots = [t for t in (r.tpot for r in good) if t is not None]
    itls = [g for r in good for g in r.itls()]
    errors = Counter(r.error for r in records if not r.ok)
    return Summary(
        sent=len(records), completed=len(good), failed=len(records) - len(good), errors=dict(errors),
        duration_s=duration, req_per_s=len(good) / duration,
        output_tok_per_s=sum(r.tokens for r in good) / duration,
        ttft_p50=percentile(ttfts, 50), ttft_p99=percentile(ttfts, 99),
        tpot_p50=percentile(tpots, 50), tpot_p99=percentile(tpots, 99), itl_p99=percentile(itls, 99),
        goodput=sum(slo.met(r) for r in good) / duration,
    )
