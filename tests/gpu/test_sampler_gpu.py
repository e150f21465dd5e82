"""Next-token choice on the GPU reads nothing back to the host: a launched step samples while
the step before it still runs (torch's sync debug mode turns any synchronizing call into an
error)."""

from __future__ import annotations

import torch

from inference_server.engine.request import SamplingParams
from inference_server.engine.sampler import SampleRow, choose


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
