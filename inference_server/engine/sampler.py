"""Next-token choice for a batch of rows, each with its own sampling parameters.

Order of processing, as vLLM's: tokens a row may not choose yet (EOS and stop ids before
``min_tokens``), ``logit_bias`` and a constrained row's grammar mask (``TokenMasks``), then the repetition penalty (every token seen, prompt
included), the presence and frequency penalties (the output's tokens and their counts), then
temperature, min-p, top-k and top-p, then a draw from the row's own generator (seeded requests
reproduce). Greedy rows are one batched argmax of the adjusted logits. Log-probabilities are
of the model's raw distribution (before any of this). Nothing is read back to the host before
the tokens: every per-row figure reaches the device through pinned memory (``to_device``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loraplex.inference_server.engine.request import SamplingParams


@dataclass(frozen=True, slots=True)
class SampleRow:
    params: SamplingParams
    seen_ids: Sequence[int]  # prompt + output so far, for the penalties
    generator: torch.Generator | None
    banned: tuple[int, ...] = ()  # token ids this step may not choose (EOS and stop ids before min_tokens)
    num_prompt: int = 0  # seen_ids[num_prompt:] is the output, which presence and frequency penalties count


@dataclass(frozen=True, slots=True)
class TokenMasks:
    """The grammar masks of a step's constrained rows (structured output; engine/grammar.py
    fills them on the host): bit j of word w of a row's mask allows token 32 w + j."""

    rows: torch.Tensor  # int64 [k]: which of the step's rows, on the logits' device
    bitmask: torch.Tensor  # int32 [k, W], on the logits' device


@dataclass(frozen=True, slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[dict[int, float] | None]


def sample(logits: torch.Tensor, rows: Sequence[SampleRow], seen: torch.Tensor | None = None,
           counts: torch.Tensor | None = None, masks: TokenMasks | None = None) -> SampleResult:
    """logits: [N, V] (any float dtype) for N rows -> one token id per row. ``seen``, ``counts``,
    ``masks``: as ``apply_penalties`` takes them (the runner keeps the first two on the device:
    ``TokenRows``)."""
    logits = logits.float()
    tokens = choose(apply_penalties(logits, rows, seen, counts, masks), rows)
    wanted = logprobs_on_device(logits, tokens, rows)
    token_list = tokens.tolist()  # the step's read-back
    if wanted is None:
        return SampleResult(token_list, [None] * len(rows), [None] * len(rows))
    return SampleResult(token_list, *read_logprobs(rows, *(t.tolist() for t in wanted)))


def choose(scores: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """int64 [N] token ids on ``scores``' device (float32 [N, V], penalties applied), with
    nothing read back to the host, so a launched step can sample: greedy rows by one batched
    argmax, the sampled rows by one batched draw (``_draw``)."""
    tokens = scores.argmax(dim=-1)
    drawn = [i for i, row in enumerate(rows) if not row.params.greedy]
    if drawn:
        index = to_device(drawn, scores.device)
        tokens[index] = _draw(scores[index], [rows[i] for i in drawn])
    return tokens


def to_device(values: list[int] | list[float], device: torch.device) -> torch.Tensor:
    """A small host list on ``device`` without a stream sync (a blocking copy would wait for
    the step in flight: what a launched step must not do). On CUDA through pinned memory, which
    torch's host allocator keeps until the copy is done."""
    host = torch.tensor(values)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def apply_penalties(logits: torch.Tensor, rows: Sequence[SampleRow], seen: torch.Tensor | None = None,
                    counts: torch.Tensor | None = None, masks: TokenMasks | None = None) -> torch.Tensor:
    """``logits`` (float32 [N, V]) adjusted by each row's banned tokens, logit bias, grammar mask
    (``masks``: the constrained rows') and penalties (a new tensor; ``logits`` itself, which
    log-probabilities read, is left as it is; returned as it is when no row adjusts anything). ``seen``: bool [N, V], the tokens each
    repetition-penalized row has seen (``TokenRows.seen``'s, kept on the device across steps);
    ``counts``: int32 [N, V], each presence- or frequency-penalized row's output token counts
    (``TokenRows.counts``'); each is built from the rows' ``seen_ids`` when not given. Nothing is
    read back to the host."""
    out = _biased(logits, rows, masks)
    penalties = [r.params.repetition_penalty for r in rows]
    if any(p != 1.0 for p in penalties):
        if seen is None:
            seen = seen_mask(rows, logits.shape[-1], logits.device)
        penalty = to_device(penalties, logits.device)[:, None]
        out = torch.where(seen, torch.where(out < 0, out * penalty, out / penalty), out)
    if any(r.params.counts_output for r in rows):
        if counts is None:
            counts = output_counts(rows, logits.shape[-1], logits.device)
        frequency = to_device([r.params.frequency_penalty for r in rows], logits.device)[:, None]
        presence = to_device([r.params.presence_penalty for r in rows], logits.device)[:, None]
        out = out - frequency * counts - presence * (counts > 0)
    return out


def _biased(logits: torch.Tensor, rows: Sequence[SampleRow], masks: TokenMasks | None = None) -> torch.Tensor:
    """``logits`` plus each row's logit_bias, with its banned tokens and the tokens its grammar
    mask (if it has one) does not allow at -inf (a copy when any row has any of these;
    ``logits`` otherwise)."""
    vocab = logits.shape[-1]
    where: list[int] = []
    bias: list[float] = []
    banned: list[int] = []
    for i, row in enumerate(rows):
        for token, value in row.params.logit_bias:
            where.append(i * vocab + token)
            bias.append(value)
        banned += [i * vocab + t for t in row.banned]
    if not where and not banned and masks is None:
        return logits
    out = logits.clone()
    if masks is not None:
        constrained = out.index_select(0, masks.rows)
        apply_bitmask(constrained, masks.bitmask)
        out.index_copy_(0, masks.rows, constrained)
    flat = out.view(-1)
    if where:
        flat.index_add_(0, to_device(where, out.device), to_device(bias, out.device).float())
    if banned:
        flat.index_fill_(0, to_device(banned, out.device), float("-inf"))
    return out


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: ``logits`` (float [n, V]) at -inf wherever ``bitmask`` (int32 [n, W] on
    ``logits``' device; bit j of word w allows token 32 w + j, the layout xgrammar fills) has a
    0, and for every token past its 32 W bits (ids the tokenizer does not have). The words are
    read as little-endian bytes, each unpacked to 8 bools: one small tensor op and one
    masked_fill, nothing read back."""
    n, vocab = logits.shape
    shifts = torch.arange(8, dtype=torch.uint8, device=bitmask.device)
    allowed = ((bitmask.contiguous().view(torch.uint8)[:, :, None] >> shifts) & 1).view(n, -1).view(torch.bool)
    width = min(vocab, allowed.shape[1])
    logits[:, :width].masked_fill_(allowed[:, :width].logical_not(), float("-inf"))
    if width < vocab:
        logits[:, width:] = float("-inf")


def output_counts(rows: Sequence[SampleRow], vocab: int, device: torch.device) -> torch.Tensor:
    """int32 [N, vocab]: how often each token occurs in each counting row's output (its
    ``seen_ids`` past ``num_prompt``; placeholders, -1, are not tokens), from scratch: for
    callers that keep no ``TokenRows``."""
    flat: list[int] = []
    for i, row in enumerate(rows):
        if row.params.counts_output:
            flat += [i * vocab + t for t in row.seen_ids[row.num_prompt :] if t >= 0]
    counts = torch.zeros(len(rows) * vocab, dtype=torch.int32, device=device)
    if flat:
        counts.index_add_(0, to_device(flat, device), torch.ones(len(flat), dtype=torch.int32, device=device))
    return counts.view(len(rows), vocab)


def seen_mask(rows: Sequence[SampleRow], vocab: int, device: torch.device) -> torch.Tensor:
    """bool [N, vocab]: the ids in each penalized row's ``seen_ids`` (placeholders, -1, are not
    tokens), from scratch: O(all those ids) host work, for callers that keep no ``SeenTokens``.
    Set by ``index_fill_``'s scalar form: ``mask[i, j] = True`` on CUDA would copy ``True`` to
    the device with a blocking copy, a stream sync."""
    flat: list[int] = []
    for i, row in enumerate(rows):
        if row.params.repetition_penalty != 1.0:
            flat += [i * vocab + t for t in set(row.seen_ids) if t >= 0]
    mask = torch.zeros(len(rows), vocab, dtype=torch.bool, device=device)
    if flat:
        mask.view(-1).index_fill_(0, to_device(flat, device), True)
    return mask


def _draw(scores: torch.Tensor, rows: Sequence[SampleRow]) -> torch.Tensor:
    """One token per row of ``scores`` (float32 [n, V]), each row with its own temperature,
    min-p, top-k and top-p. The draw is the exponential race: argmax(p / q), q ~ Exp(1) from the
    row's generator, picks token t with probability p_t; it is what torch.multinomial does for
    one sample, without multinomial's check of p, which reads a value back to the host."""
    device, vocab = scores.device, scores.shape[-1]
    scores = scores / to_device([r.params.temperature for r in rows], device)[:, None]
    if any(r.params.min_p > 0 for r in rows):  # p < min_p * p_max  <=>  score < max score + log(min_p)
        floor = to_device([math.log(r.params.min_p) if r.params.min_p > 0 else -math.inf for r in rows], device)
        scores = scores.masked_fill(scores < scores.amax(dim=-1, keepdim=True) + floor[:, None], float("-inf"))
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
    kth = ordered.gather(1, to_device(top_k, device)[:, None] - 1)
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    probs = ordered.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs  # the mass of the tokens more likely than each
    cut = ordered.isneginf() | (before >= to_device(top_p, device)[:, None])
    cut[:, 0] = False  # the most likely token, even for a top-p that float32 rounds to 0
    return scores.masked_fill(cut.scatter(1, order, cut), float("-inf"))


def logprobs_on_device(logits: torch.Tensor, tokens: torch.Tensor, rows: Sequence[SampleRow]):
    """For steps with a row that wants log-probabilities (of the model's raw distribution):
    (the chosen tokens' [N], the top-K values [N, K], their ids [N, K]) on the device, K the
    largest ``top_logprobs`` of the rows; None when no row wants any."""
    if not any(r.params.logprobs or r.params.top_logprobs for r in rows):
        return None
    logp = torch.log_softmax(logits.float(), dim=-1)
    chosen = logp.gather(1, tokens[:, None])[:, 0]
    values, ids = logp.topk(max(r.params.top_logprobs for r in rows), dim=-1)
    return chosen, values, ids


def read_logprobs(rows: Sequence[SampleRow], chosen: list[float], values: list[list[float]], ids: list[list[int]]
                  ) -> tuple[list[float | None], list[dict[int, float] | None]]:
    """``logprobs_on_device``'s figures, read back, as each row asked for them."""
    logprobs: list[float | None] = []
    tops: list[dict[int, float] | None] = []
    for i, row in enumerate(rows):
        wants = row.params.logprobs or row.params.top_logprobs > 0
        logprobs.append(chosen[i] if wants else None)
        k = row.params.top_logprobs
        tops.append(dict(zip(ids[i][:k], values[i][:k])) if k else None)
    return logprobs, tops
