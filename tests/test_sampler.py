"""Next-token choice (inference_server/engine/sampler.py): ``choose`` keeps every token on the
device (what lets a launched step sample), and gives what ``sample`` gives."""

from __future__ import annotations

import torch

from inference_server.engine.request import SamplingParams
from inference_server.engine.sampler import SampleRow, choose, sample


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
