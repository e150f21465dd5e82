"""Next-token choice for a batch of rows, each with its own sampling parameters.

Order of processing, as in transformers' generate: repetition penalty, temperature,
top-k, top-p, then a draw from the row's own generator (seeded requests reproduce).
Greedy rows are one batched argmax. Log-probabilities are of the model's raw
distribution (before penalties and temperature).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from inference_server.engine.request import SamplingParams


@dataclass(frozen=True, slots=True)
class SampleRow:
    params: SamplingParams
    seen_ids: Sequence[int]  # prompt + output so far, for the repetition penalty
    generator: torch.Generator | None


@dataclass(frozen=True, slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[dict[int, float] | None]


def sample(logits: torch.Tensor, rows: Sequence[SampleRow]) -> SampleResult:
    """logits: [N, V] (any float dtype) for N rows -> one token id per row."""
    logits = logits.float()
    token_list = choose(_apply_penalties(logits, rows), rows).tolist()  # the step's one read-back
    logprobs, tops = _logprobs(logits, token_list, rows)
    return SampleResult(token_list, logprobs, tops)


def choose(scores: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """int64 [N] token ids on ``scores``' device (float32 [N, V], penalties applied), with
    nothing read back to the host: greedy rows by one batched argmax, the others drawn one by
    one from their own generators (temperature, top-k, top-p), so a launched step can sample."""
    tokens = scores.argmax(dim=-1)
    for i, row in enumerate(rows):
        if not row.params.greedy:
            tokens[i] = _draw(scores[i], row.params, row.generator)
    return tokens


def _apply_penalties(logits: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    if all(r.params.repetition_penalty == 1.0 for r in rows):
        return logits
    out = logits.clone()
    for i, row in enumerate(rows):
        penalty = row.params.repetition_penalty
        if penalty == 1.0 or not row.seen_ids:
            continue
        ids = torch.tensor(sorted(set(row.seen_ids)), device=logits.device)
        scores = out[i, ids]
        out[i, ids] = torch.where(scores < 0, scores * penalty, scores / penalty)
    return out


def _draw(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    scores = logits / params.temperature
    if params.top_k:
        k = min(params.top_k, scores.numel())
        kth = torch.topk(scores, k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - params.top_p)
        remove[-1] = False  # always keep the most likely token
        scores = scores.masked_fill(remove.scatter(0, order, remove), float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[0]  # stays on the device


def _logprobs(
    logits: torch.Tensor, tokens: list[int], rows: Sequence[SampleRow]
) -> tuple[list[float | None], list[dict[int, float] | None]]:
    want = [r.params.logprobs or r.params.top_logprobs > 0 for r in rows]
    if not any(want):
        return [None] * len(rows), [None] * len(rows)
    logp = torch.log_softmax(logits, dim=-1)
    chosen: list[float | None] = []
    tops: list[dict[int, float] | None] = []
    for i, row in enumerate(rows):
        chosen.append(float(logp[i, tokens[i]]) if want[i] else None)
        k = row.params.top_logprobs
        if k:
            values, ids = torch.topk(logp[i], k)
            tops.append(dict(zip(ids.tolist(), values.tolist())))
        else:
            tops.append(None)
    return chosen, tops
