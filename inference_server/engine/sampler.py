"""Next-token choice for a batch of rows, each with its own sampling parameters.

Order of processing, as in transformers' generate: repetition penalty, temperature,
top-k, top-p, then a draw from the row's own generator (seeded requests reproduce).
Greedy rows are one batched argmax. Log-probabilities are of the model's raw
distribution (before penalties and temperature).
"""

from __future__ import annotations

import math
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
    nothing read back to the host, so a launched step can sample: greedy rows by one batched
    argmax, the sampled rows by one batched draw (``_draw``)."""
    tokens = scores.argmax(dim=-1)
    drawn = [i for i, row in enumerate(rows) if not row.params.greedy]
    if drawn:
        index = _to_device(drawn, scores.device)
        tokens[index] = _draw(scores[index], [rows[i] for i in drawn])
    return tokens


def _to_device(values: list[int] | list[float], device: torch.device) -> torch.Tensor:
    """A small host list on ``device`` without a stream sync (a blocking copy would wait for
    the step in flight: what a launched step must not do). On CUDA through pinned memory, which
    torch's host allocator keeps until the copy is done."""
    host = torch.tensor(values)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


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


def _draw(scores: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """One token per row of ``scores`` (float32 [n, V]), each row with its own temperature,
    top-k and top-p. The draw is the exponential race: argmax(p / q), q ~ Exp(1) from the
    row's generator, picks token t with probability p_t; it is what torch.multinomial does for
    one sample, without multinomial's check of p, which reads a value back to the host."""
    device, vocab = scores.device, scores.shape[-1]
    scores = scores / _to_device([r.params.temperature for r in rows], device)[:, None]
    top_k = [min(r.params.top_k, vocab) or vocab for r in rows]
    top_p = [r.params.top_p if r.params.top_p < 1.0 else math.inf for r in rows]
    if min(top_k) < vocab or min(top_p) < 1.0:
        scores = _nucleus(scores, top_k, top_p)
    probs = scores.softmax(dim=-1)
    race = torch.empty_like(probs)
    if any(r.generator is None for r in rows):
        race.exponential_()
    for j, row in enumerate(rows):
        if row.generator is not None:
            race[j].exponential_(generator=row.generator)
    return (probs / race.clamp_min_(torch.finfo(race.dtype).tiny)).argmax(dim=-1)


def _nucleus(scores: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """``scores`` with -inf outside each row's top-k, then outside the smallest set of most
    likely tokens whose probability reaches top-p (the most likely token always stays)."""
    device = scores.device
    ordered, order = scores.sort(dim=-1, descending=True)
    kth = ordered.gather(1, _to_device(top_k, device)[:, None] - 1)
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    probs = ordered.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # the mass of the tokens more likely than each
    cut = ordered.isneginf() | (before >= _to_device(top_p, device)[:, None])
    return scores.masked_fill(cut.scatter(1, order, cut), float("-inf"))


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
