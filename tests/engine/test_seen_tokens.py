"""SeenTokens keeps each penalized sequence's seen-token row on the device across steps,
adding only new tokens: at every step its mask must equal the one built from scratch from
the host's token ids (sampler.seen_mask), with a launched step's newest token taken from the
device, and a freed row must not leak its tokens into the sequence that takes it next."""

from __future__ import annotations

import torch

from loraplex.inference_server.engine.request import GenerationRequest, SamplingParams, StoppingCriteria
from loraplex.inference_server.engine.sampler import SampleRow, seen_mask
from loraplex.inference_server.engine.seen_tokens import SeenTokens
from loraplex.inference_server.engine.sequence import PLACEHOLDER, Sequence

VOCAB = 40
CPU = torch.device("cpu")


def _seq(rid: str, prompt: tuple[int, ...], penalty: float) -> Sequence:
    request = GenerationRequest(rid, prompt, None, SamplingParams(repetition_penalty=penalty),
                                StoppingCriteria(max_new_tokens=50))
    return Sequence.create(request, None, None, None)


def _from_scratch(seqs: list[Sequence]) -> torch.Tensor:
    return seen_mask([SampleRow(s.request.sampling, s.token_ids, None) for s in seqs], VOCAB, CPU)


def test_rows_grow_by_new_tokens_and_equal_the_mask_from_scratch() -> None:
    seqs = [_seq("a", (1, 2, 2), 1.3), _seq("b", (3,), 1.0), _seq("c", (4, 5), 0.7)]
    seen = SeenTokens(max_seqs=4)
    gen = torch.Generator().manual_seed(0)
    for _ in range(12):
        assert torch.equal(seen.mask(seqs, VOCAB, CPU), _from_scratch(seqs))
        for s in seqs:
            s.token_ids.append(int(torch.randint(VOCAB, (1,), generator=gen)))
    assert not seen.mask(seqs, VOCAB, CPU)[1].any()  # no penalty: nothing marked


def test_a_launched_steps_newest_token_comes_from_the_device() -> None:
    a, b = _seq("a", (1, 2), 1.3), _seq("b", (3,), 1.3)
    seen = SeenTokens(max_seqs=2)
    seen.mask([a, b], VOCAB, CPU)
    a.token_ids.append(PLACEHOLDER)  # a's newest token is still being sampled
    got = seen.mask([a, b], VOCAB, CPU, newest=([0], torch.tensor([17])))
    a.token_ids[-1] = 17  # what the host reads later
    assert torch.equal(got, _from_scratch([a, b]))
    a.token_ids.append(PLACEHOLDER)
    got = seen.mask([a, b], VOCAB, CPU, newest=([0], torch.tensor([9])))
    a.token_ids[-1] = 9
    assert torch.equal(got, _from_scratch([a, b]))


def test_a_freed_row_starts_empty_for_the_next_sequence() -> None:
    seen = SeenTokens(max_seqs=1)
    first = _seq("a", (1, 2, 3), 1.3)
    seen.mask([first], VOCAB, CPU)
    second = _seq("b", (7,), 1.3)  # takes the one row: ``first`` left the step
    assert torch.equal(seen.mask([second], VOCAB, CPU), _from_scratch([second]))
    first.token_ids.append(4)  # back (after a preemption, say): rebuilt from its token ids
    assert torch.equal(seen.mask([first], VOCAB, CPU), _from_scratch([first]))


def test_no_penalized_row_gives_no_mask() -> None:
    assert SeenTokens(max_seqs=2).mask([_seq("a", (1,), 1.0)], VOCAB, CPU) is None
