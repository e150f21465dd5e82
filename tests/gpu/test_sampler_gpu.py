"""Next-token choice on the GPU reads nothing back to the host: a launched step samples while
the step before it still runs (torch's sync debug mode turns any synchronizing call into an
error). So do the repetition penalties, whose seen-token rows the runner keeps on the device
(SeenTokens), and the stateless mask (sampler.seen_mask)."""

from __future__ import annotations

import torch

from loraplex.inference_server.engine.request import GenerationRequest, SamplingParams, StoppingCriteria
from loraplex.inference_server.engine.sampler import SampleRow, apply_penalties, choose, seen_mask
from loraplex.inference_server.engine.seen_tokens import SeenTokens
from loraplex.inference_server.engine.sequence import PLACEHOLDER, Sequence


def _rows() -> list[SampleRow]:
    def seeded(seed: int, **params) -> SampleRow:
        generator = torch.Generator(device="cuda").manual_seed(seed)
        return SampleRow(SamplingParams(seed=seed, **params), (), generator)

    return [SampleRow(SamplingParams(), (), None),  # greedy
            seeded(1, temperature=0.8, top_p=0.95),
            SampleRow(SamplingParams(temperature=1.0), (), None),  # the default generator
            seeded(2, temperature=1.2, top_k=1),
            seeded(3, temperature=0.7, top_k=40, top_p=0.9)]


def test_choose_reads_nothing_back() -> None:
    scores = torch.randn(5, 32000, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0)) * 4
    rows = _rows()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        tokens = choose(scores, rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    best = scores.argmax(dim=-1).tolist()
    assert tokens.device.type == "cuda" and tokens.tolist()[0] == best[0] and tokens.tolist()[3] == best[3]
    again = choose(scores, _rows()).tolist()  # fresh generators, the same seeded draws
    assert [again[i] for i in (1, 3, 4)] == [tokens.tolist()[i] for i in (1, 3, 4)]


def _penalized(rid: str, prompt: tuple[int, ...], penalty: float) -> Sequence:
    request = GenerationRequest(rid, prompt, None, SamplingParams(repetition_penalty=penalty),
                                StoppingCriteria(max_new_tokens=50))
    return Sequence.create(request, None, None, None)


def test_penalties_read_nothing_back_and_equal_the_mask_from_scratch() -> None:
    """Two steps as a launched step runs them: the newest token of each sequence is still a
    placeholder on the host and comes from the device."""
    cuda = torch.device("cuda")
    logits = torch.randn(3, 32000, device=cuda, generator=torch.Generator(device=cuda).manual_seed(0)) * 4
    seqs = [_penalized("a", (5, 9, 5, 31999), 1.3), _penalized("b", (7,), 1.0), _penalized("c", (1, 2), 0.8)]
    seen = SeenTokens(max_seqs=4)
    for newest in (123, 456):
        for s in seqs:
            s.token_ids.append(PLACEHOLDER)
        on_device = torch.tensor([newest, newest + 1, newest + 2], device=cuda)
        penalized_newest = ([0, 2], on_device[torch.tensor([0, 2], device=cuda)])
        rows = [SampleRow(s.request.sampling, s.token_ids, None) for s in seqs]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = apply_penalties(logits, rows, seen.mask(seqs, 32000, cuda, penalized_newest))
            seen_mask(rows, 32000, cuda)  # the stateless mask: no sync either
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for s, t in zip(seqs, on_device.tolist()):
            s.token_ids[-1] = t  # what the host reads later
        expected = apply_penalties(logits, [SampleRow(s.request.sampling, s.token_ids, None) for s in seqs])
        assert torch.equal(got, expected)
