"""bench_open_loop's figures (benchmarks/serving/open_loop_metrics.py, open_loop_report.py) from
hand-made timestamps."""

from __future__ import annotations

import math

import pytest

from benchmarks.serving.open_loop_metrics import RequestRecord, Slo, summarize
from benchmarks.serving.open_loop_report import RunKey, failures, table


def _rec(i: int, sent: float, arrivals: list[float], tokens: int, expected: int | None = None,
         error: str | None = None) -> RequestRecord:
    r = RequestRecord(i, "a", 10, expected if expected is not None else tokens, sent, arrivals, tokens, error,
                      arrivals[-1] if arrivals else sent + 1)
    r.fail_if_short()
    return r


def test_ttft_tpot_and_itl_of_one_request() -> None:
    r = _rec(0, 1.0, [1.2, 1.3, 1.5], tokens=5)  # the last message carries 3 tokens
    assert r.ttft == pytest.approx(0.2)
    assert r.tpot == pytest.approx(0.3 / 4)
    assert r.itls() == pytest.approx([0.1, 0.2])
    assert _rec(1, 0.0, [0.5], tokens=1).tpot is None
    both = RequestRecord(2, "a", 10, 10, 0.0, [0.1, 0.2, 0.5], 10, choices=2)  # 2 choices of 5, side by side
    assert both.tpot == pytest.approx(0.4 / 4)


def test_summary_of_two_requests_is_exact() -> None:
    records = [_rec(0, 0.0, [0.1, 0.2, 0.3], tokens=3),  # TTFT 0.1, TPOT 0.1
               _rec(1, 1.0, [1.5, 1.5 + 0.04 * 4], tokens=5)]  # TTFT 0.5, TPOT 0.04; done at 1.66
    s = summarize(records, Slo(ttft_s=1.0, tpot_s=0.05))
    assert (s.sent, s.completed, s.failed) == (2, 2, 0)
    assert s.duration_s == pytest.approx(1.66)
    assert s.req_per_s == pytest.approx(2 / 1.66)
    assert s.output_tok_per_s == pytest.approx(8 / 1.66)
    assert s.ttft_p50 == pytest.approx(0.3) and s.ttft_p99 == pytest.approx(0.1 + 0.4 * 0.99)
    assert s.tpot_p50 == pytest.approx(0.07)
    assert s.goodput == pytest.approx(1 / 1.66)  # the first misses TPOT <= 50 ms
    assert s.itl_p99 == pytest.approx(0.16, abs=0.01)


def test_goodput_applies_both_objectives() -> None:
    fast = _rec(0, 0.0, [0.1, 0.11], tokens=2)
    slow_first = _rec(1, 0.0, [2.0, 2.01], tokens=2)
    one_token = _rec(2, 0.0, [0.2], tokens=1)  # no TPOT: meets any TPOT objective
    s = summarize([fast, slow_first, one_token], Slo(ttft_s=1.0, tpot_s=0.05))
    assert s.goodput == pytest.approx(2 / 2.01)
    assert summarize([fast, slow_first, one_token], Slo(ttft_s=3.0, tpot_s=0.005)).goodput == pytest.approx(1 / 2.01)


def test_failures_are_counted_named_and_kept_out_of_the_latencies() -> None:
    ok = _rec(0, 0.0, [0.1, 0.2], tokens=2)
    short = _rec(1, 0.0, [0.1, 0.15], tokens=2, expected=4)
    refused = _rec(2, 0.0, [], tokens=0, expected=4, error="gRPC RESOURCE_EXHAUSTED")  # done at 1.0
    s = summarize([ok, short, refused], Slo())
    assert (s.sent, s.completed, s.failed) == (3, 1, 2)
    assert s.errors == {"streamed 2 of 4 tokens": 1, "gRPC RESOURCE_EXHAUSTED": 1}
    assert s.duration_s == pytest.approx(1.0)  # the failed request's end counts
    assert s.ttft_p50 == pytest.approx(0.1) and s.output_tok_per_s == pytest.approx(2.0)
    runs = {RunKey("on", "grpc", "skewed", 100, 4.0): s}
    assert failures(runs) == ["- grpc skewed N=100 @ 4 req/s (prefix cache on): 2 of 3 failed "
                              "(gRPC RESOURCE_EXHAUSTED x1, streamed 2 of 4 tokens x1)"]
    assert "| 1 / 3 |" in table(runs, with_prefix=False)[2]


def test_a_request_with_no_message_is_a_failure_not_a_crash() -> None:
    s = summarize([_rec(0, 0.0, [], tokens=0, expected=3)], Slo())
    assert s.failed == 1 and math.isnan(s.ttft_p50) and s.goodput == 0


def test_overhead_against_the_base_model_at_the_same_rate() -> None:
    base = summarize([_rec(0, 0.0, [0.1, 0.2, 0.3], tokens=3)], Slo())  # TPOT 100 ms, 10 tok/s
    lora = summarize([_rec(0, 0.0, [0.1, 0.3, 0.5], tokens=3)], Slo())  # TPOT 200 ms, 6 tok/s
    other_rate = summarize([_rec(0, 0.0, [0.1, 0.15], tokens=2)], Slo())
    runs = {RunKey("on", "grpc", "distinct", 8, 2.0): lora, RunKey("on", "grpc", "base", 0, 2.0): base,
            RunKey("on", "grpc", "uniform", 8, math.inf): other_rate}
    lines = table(runs, with_prefix=False)
    assert lines[2].endswith("| -40.0% | +100.0% |")
    assert lines[3].endswith("| - | - |") and "| base | - | 2 |" in lines[3]
    assert lines[4].endswith("| - | - |")  # no base run at rate inf


def test_slo_bounds_must_be_positive() -> None:
    with pytest.raises(ValueError):
        Slo(ttft_s=0.0)


def test_prefix_cache_columns_show_the_setting_and_the_share_served_from_cache() -> None:
    s = summarize([_rec(0, 0.0, [0.1, 0.2], tokens=2)], Slo())
    on, off = RunKey("on", "http", "uniform", 4, 2.0), RunKey("off", "http", "uniform", 4, 2.0)
    lines = table({on: s, off: s}, with_prefix=True, hits={on: 0.25})
    assert lines[0].startswith("| prefix cache | edge |") and lines[0].endswith("| prompt tokens from cache |")
    assert lines[2].startswith("| on | http | uniform | 4 |") and lines[2].endswith("| 25% |")
    assert lines[3].startswith("| off |") and lines[3].endswith("| n/a |")
    assert len({line.count("|") for line in lines}) == 1
