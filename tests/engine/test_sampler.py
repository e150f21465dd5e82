"""Next-token choice (inference_server/engine/sampler.py): ``choose`` keeps every token on the
device (what lets a launched step sample), and gives what ``sample`` gives."""

from __future__ import annotations

import torch

from loraplex.inference_server.engine.request import SamplingParams
from loraplex.inference_server.engine.sampler import SampleRow, apply_penalties, choose, sample, seen_mask


def _rows(seeds: list[int | None]) -> list[SampleRow]:
    """Greedy rows where the seed is None; the others sample with their own generator."""
    rows = []
    for seed in seeds:
        if seed is None:
            rows.append(SampleRow(SamplingParams(), (), None))
        else:
            params = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=seed)
            rows.append(SampleRow(params, (), torch.Generator().manual_seed(seed)))
    return rows


def test_choose_is_sample_without_reading_anything_back() -> None:
    scores = torch.randn(6, 300, generator=torch.Generator().manual_seed(0)) * 3
    seeds = [None, 3, None, 4, 5, None]
    tokens = choose(scores, _rows(seeds))
    assert isinstance(tokens, torch.Tensor) and tokens.dtype == torch.int64 and tokens.shape == (6,)
    for _ in range(3):  # the same draws from freshly seeded generators, step after step
        assert sample(scores, _rows(seeds)).token_ids == tokens.tolist()
    greedy = [i for i, s in enumerate(seeds) if s is None]
    assert tokens[greedy].tolist() == scores[greedy].argmax(dim=-1).tolist()


def test_draws_keep_to_top_k_and_follow_the_generator() -> None:
    scores = torch.randn(1, 500, generator=torch.Generator().manual_seed(1))
    top = set(scores[0].topk(20).indices.tolist())
    rows = _rows([11])
    drawn = [int(choose(scores, rows)[0]) for _ in range(200)]  # one generator, advancing
    assert set(drawn) <= top and len(set(drawn)) > 3
    again = _rows([11])
    assert [int(choose(scores, again)[0]) for _ in range(200)] == drawn


def _row(seed: int | None = None, **params) -> SampleRow:
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    return SampleRow(SamplingParams(seed=seed, **params), (), generator)


def test_draws_follow_the_distribution() -> None:
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    rows = [_row(temperature=1.0)] * 8000  # unseeded rows: the default generator
    torch.manual_seed(0)
    drawn = choose(probs.log().expand(len(rows), -1).contiguous(), rows)
    freq = torch.bincount(drawn, minlength=5).double() / len(rows)
    assert torch.allclose(freq, probs.double(), atol=0.02), freq  # ~4 standard errors


def test_top_p_keeps_the_smallest_set_that_reaches_it() -> None:
    probs = torch.tensor([0.05, 0.4, 0.3, 0.2, 0.05])
    scores = probs.log().expand(300, -1).contiguous()
    rows = [_row(seed=i, temperature=1.0, top_p=0.65) for i in range(300)]
    drawn = set(choose(scores, rows).tolist())
    assert drawn == {1, 2}  # 0.4 < 0.65 <= 0.4 + 0.3: the third most likely token is out


def test_rows_of_one_batch_keep_their_own_parameters() -> None:
    scores = torch.randn(1, 400, generator=torch.Generator().manual_seed(2)) * 2
    best = int(scores.argmax())
    rows = [_row(seed=1, temperature=1.5, top_k=1), _row(seed=2, temperature=1.5, top_p=1e-6),
            _row(seed=3, temperature=1.5), _row(seed=4, temperature=1.5, top_k=5)]
    top5 = set(scores[0].topk(5).indices.tolist())
    seen: list[set[int]] = [set() for _ in rows]
    for _ in range(50):
        for j, token in enumerate(choose(scores.expand(len(rows), -1).contiguous(), rows).tolist()):
            seen[j].add(token)
    assert seen[0] == {best} and seen[1] == {best}
    assert len(seen[2]) > 10 and seen[3] <= top5 and len(seen[3]) > 1


def test_a_seeded_row_draws_the_same_whatever_shares_its_batch() -> None:
    scores = torch.randn(3, 300, generator=torch.Generator().manual_seed(3))
    alone = choose(scores[2:], [_row(seed=9, temperature=0.8, top_p=0.9)])
    shared = choose(scores, [_row(), _row(temperature=1.0), _row(seed=9, temperature=0.8, top_p=0.9)])
    assert int(shared[2]) == int(alone[0])


def test_penalties_count_each_seen_token_once_and_skip_placeholders() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(4)) * 3
    rows = [SampleRow(SamplingParams(repetition_penalty=1.5), (5, 9, 5, 7, 9, -1), None),  # -1: a placeholder
            SampleRow(SamplingParams(), (5, 9), None),  # no penalty: untouched
            SampleRow(SamplingParams(repetition_penalty=0.5), (2,), None)]
    got = apply_penalties(logits, rows)
    expected = logits.clone()
    for i, ids, p in ((0, (5, 7, 9), 1.5), (2, (2,), 0.5)):
        for t in ids:
            x = float(logits[i, t])
            expected[i, t] = x * p if x < 0 else x / p
    assert torch.allclose(got, expected, rtol=1e-6, atol=0)
    changed = (got != logits).nonzero().tolist()
    assert changed == [[0, 5], [0, 7], [0, 9], [2, 2]]
    given = apply_penalties(logits, rows, seen_mask(rows, 50, logits.device))
    assert torch.equal(given, got)  # a mask handed in (the runner's SeenTokens) is applied the same way


def test_extreme_but_valid_parameters_still_choose_a_real_token() -> None:
    """Tiny temperatures, tiny top-p and extreme penalties that float32 cannot carry as given
    (1e-38 / logits overflowed to inf, top-p 1e-46 rounded to 0 cut even the top token) choose
    the most likely token, never token 0 out of NaN scores."""
    scores = torch.randn(1, 300, generator=torch.Generator().manual_seed(3)) * 4
    best = int(scores.argmax())
    assert best != 0
    for params in (dict(temperature=1e-38, seed=1), dict(temperature=9e-6, seed=1),
                   dict(temperature=1.0, top_p=1e-46, seed=1)):
        row = _row(**params)
        assert int(choose(scores, [row])[0]) == best, params
    assert SamplingParams(temperature=1e-38).greedy and not SamplingParams(temperature=1e-5).greedy
    seen = _row(temperature=1.0, seed=2, repetition_penalty=1e-6)
    seen = SampleRow(seen.params, (best,), seen.generator)
    penalized = apply_penalties(scores.clone(), [seen])
    assert torch.isfinite(penalized).all()


def test_repetition_penalties_outside_what_float32_carries_are_refused() -> None:
    import pytest

    from loraplex.adapter_store.errors import InvalidRequestError

    for bad in (1e-300, 1e-7, 1e7, 0.0, -1.0, float("nan")):
        with pytest.raises(InvalidRequestError, match=r"must be in \[1e-06, 1e\+06\]"):
            SamplingParams(repetition_penalty=bad)
    assert SamplingParams(repetition_penalty=1e-6).repetition_penalty == 1e-6
