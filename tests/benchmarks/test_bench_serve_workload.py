"""bench_open_loop's request stream (benchmarks/serving/open_loop_workload.py): seeded, Poisson, bounded lengths,
adapter draws that have the properties their names claim, shared prefixes per adapter."""

from __future__ import annotations

import math
import pickle
from collections import Counter
from dataclasses import replace

import numpy as np
import pytest

from benchmarks.serving.open_loop_workload import (
    FIRST_TOKEN_ID,
    LengthDist,
    WorkloadSpec,
    arrival_offsets,
    build_requests,
    draw_adapters,
    zipf_weights,
)

ADAPTERS = tuple(f"a{i}" for i in range(8))


def _spec(**kw) -> WorkloadSpec:  # noqa: ANN003
    base = dict(workload="uniform", adapters=ADAPTERS, rate=4.0, num_requests=200, vocab_size=512,
                prompt=LengthDist(32, 1.0, 128), output=LengthDist(16, 0.8, 64))
    return WorkloadSpec(**{**base, **kw})


def test_the_same_seed_gives_the_same_requests_and_another_seed_others() -> None:
    assert build_requests(_spec(seed=3)) == build_requests(_spec(seed=3))
    assert build_requests(_spec(seed=3)) != build_requests(_spec(seed=4))


def test_requests_survive_pickling_to_the_client_processes() -> None:
    requests = build_requests(_spec(num_requests=5))
    assert pickle.loads(pickle.dumps(requests)) == requests


def test_poisson_gaps_have_mean_one_over_rate_and_are_exponential() -> None:
    rng = np.random.default_rng(0)
    sends = arrival_offsets(rng, 20000, 8.0)
    gaps = np.diff(sends)
    assert sends[0] == 0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.03)
    assert gaps.std() == pytest.approx(1 / 8.0, rel=0.05)  # exponential: std = mean
    assert np.mean(gaps > 1 / 8.0) == pytest.approx(math.exp(-1), abs=0.02)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_bursty_arrivals_keep_the_rate_and_spread_the_gaps_by_1_over_sqrt_b(burstiness: float) -> None:
    """As vllm bench serve --burstiness: gamma gaps of shape b and mean 1/rate, so the offered rate
    stays and only how clumped the arrivals are changes (coefficient of variation 1/sqrt(b))."""
    sends = arrival_offsets(np.random.default_rng(0), 40000, 8.0, burstiness)
    gaps = np.diff(sends)
    assert sends[0] == 0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / 8.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(burstiness ** -0.5, rel=0.05)


def test_burstiness_1_is_the_poisson_stream_and_bad_values_are_refused() -> None:
    assert build_requests(_spec(burstiness=1.0)) == build_requests(_spec())
    bursty = build_requests(_spec(burstiness=0.25))
    assert [r.send_at for r in bursty] != [r.send_at for r in build_requests(_spec())]
    for bad in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="burstiness"):
            _spec(burstiness=bad)


def test_rate_inf_sends_everything_at_once() -> None:
    assert {r.send_at for r in build_requests(_spec(rate=math.inf))} == {0.0}


def test_lengths_and_arrivals_do_not_depend_on_the_workload() -> None:
    """A paired comparison: at one rate every workload sends the same lengths at the same times."""
    base = build_requests(_spec(workload="base", adapters=()))
    skewed = build_requests(_spec(workload="skewed"))
    assert [(r.send_at, len(r.prompt), r.output_len) for r in base] == \
           [(r.send_at, len(r.prompt), r.output_len) for r in skewed]
    assert all(r.adapter is None for r in base)


def test_lengths_stay_within_their_bounds_and_near_their_mean() -> None:
    dist = LengthDist(224, 1.0, 1024)
    lengths = dist.draw(np.random.default_rng(1), 50000)
    assert lengths.min() >= 4 and lengths.max() <= 1024
    assert lengths.min() == 4 and lengths.max() == 1024  # the tails reach both clips
    assert lengths.mean() == pytest.approx(224, rel=0.02)  # located so that the clip keeps the mean
    assert np.median(lengths) == pytest.approx(math.exp(dist.mu), rel=0.03)  # log-normal median
    assert 130 < math.exp(dist.mu) < 160  # ShareGPT-like: median well under the mean


def test_a_mean_the_bounds_cannot_reach_is_refused() -> None:
    with pytest.raises(ValueError, match="raise the max length"):
        LengthDist(224, 1.0, 128)


def test_prompts_have_their_drawn_length_and_ids_in_the_vocab() -> None:
    requests = build_requests(_spec(vocab_size=100))
    assert all(4 <= len(r.prompt) <= 128 and 4 <= r.output_len <= 64 for r in requests)
    ids = {t for r in requests for t in r.prompt}
    assert min(ids) >= FIRST_TOKEN_ID and max(ids) < 100


def test_distinct_gives_consecutive_requests_different_adapters() -> None:
    drawn = draw_adapters("distinct", np.random.default_rng(0), 20, ADAPTERS)
    assert drawn[:8] == list(ADAPTERS) and drawn[8:16] == list(ADAPTERS)
    assert all(len(set(drawn[i:i + 8])) == 8 for i in range(13))


def test_uniform_spreads_requests_evenly() -> None:
    counts = Counter(draw_adapters("uniform", np.random.default_rng(0), 16000, ADAPTERS))
    assert set(counts) == set(ADAPTERS)
    assert all(c == pytest.approx(2000, rel=0.1) for c in counts.values())


def test_skewed_follows_zipf_with_a_seeded_popularity_order() -> None:
    n = 40000
    counts = Counter(draw_adapters("skewed", np.random.default_rng(0), n, ADAPTERS, alpha=1.5))
    shares = sorted((c / n for c in counts.values()), reverse=True)
    expected = zipf_weights(len(ADAPTERS), 1.5)
    assert shares[0] == pytest.approx(expected[0], abs=0.01)  # ~0.46: the hottest adapter
    assert shares[1] == pytest.approx(expected[1], abs=0.01)
    assert shares[0] > 2.5 * shares[1] > shares[2]
    hottest = counts.most_common(1)[0][0]
    other_seed = Counter(draw_adapters("skewed", np.random.default_rng(7), n, ADAPTERS)).most_common(1)[0][0]
    assert {hottest, other_seed} != {ADAPTERS[0]}  # not always the first id


def test_zipf_weights_sum_to_one_and_fall_as_a_power() -> None:
    w = zipf_weights(5, 2.0)
    assert w.sum() == pytest.approx(1.0)
    assert w[0] / w[1] == pytest.approx(4.0) and w[0] / w[4] == pytest.approx(25.0)


def test_shared_prefix_is_one_per_adapter_and_the_rest_is_fresh() -> None:
    spec = _spec(shared_prefix_len=32, workload="uniform")
    requests = build_requests(spec)
    by_adapter: dict[str, set] = {}
    for r in requests:
        by_adapter.setdefault(r.adapter, set()).add(r.prompt[:32])
        assert len(r.prompt) == 32 + len(build_requests(replace(spec, shared_prefix_len=0))[r.index].prompt)
    assert all(len(prefixes) == 1 for prefixes in by_adapter.values())
    assert len({p for prefixes in by_adapter.values() for p in prefixes}) == len(by_adapter) == len(ADAPTERS)
    suffixes = [r.prompt[32:48] for r in requests]
    assert len(set(suffixes)) == len(suffixes)  # no request shares more than the system prompt


def test_every_run_gets_other_token_ids_so_no_run_hits_another_in_the_prefix_cache() -> None:
    one, two = build_requests(_spec(salt=1, shared_prefix_len=16)), build_requests(_spec(salt=2, shared_prefix_len=16))
    assert [len(r.prompt) for r in one] == [len(r.prompt) for r in two]
    assert not {r.prompt[:16] for r in one} & {r.prompt[:16] for r in two}


@pytest.mark.parametrize("bad", [dict(workload="zipf"), dict(rate=0.0), dict(workload="skewed", adapters=()),
                                 dict(num_requests=0), dict(vocab_size=5), dict(shared_prefix_len=-1),
                                 dict(constrained_fraction=1.5)])
def test_bad_specs_are_refused(bad: dict) -> None:
    with pytest.raises(ValueError):
        _spec(**bad)


def test_bad_length_bounds_are_refused() -> None:
    with pytest.raises(ValueError, match="low <= high"):
        LengthDist(10, 1.0, high=3)


def test_the_constrained_share_is_drawn_apart_from_everything_else() -> None:
    plain = build_requests(_spec())
    mixed = build_requests(_spec(constrained_fraction=0.25))
    assert not any(r.constrained for r in plain)
    assert 30 <= sum(r.constrained for r in mixed) <= 70  # 25% of 200
    assert [replace(r, constrained=False) for r in mixed] == plain  # nothing else moves
    assert all(r.constrained for r in build_requests(_spec(constrained_fraction=1.0)))
