"""The portable paged attention (inference_server/model/attention.py) keeps requests apart: one
sequence's cache, even non-finite, never reaches another's output."""

from __future__ import annotations

import torch

from loraplex.inference_server.model.attention import AttentionMetadata, SequenceSpan, paged_attention

HQ, HKV, D, BLOCK = 4, 2, 8, 4


def _spans(lengths: list[int], first_slots: list[int]) -> list[SequenceSpan]:
    return [SequenceSpan(q_start=i, q_len=1, ctx_len=n, kv_slots=torch.arange(s, s + n))
            for i, (n, s) in enumerate(zip(lengths, first_slots, strict=True))]


def test_a_batched_decode_is_each_sequence_alone_even_beside_a_non_finite_cache() -> None:
    """Decode rows share one padded call: a short sequence's padding must not gather another
    sequence's slots (0 x NaN is NaN), so beside a longer sequence whose cache holds NaN and inf
    (an adapter that overflowed, in slots 0-8), a healthy one gets its result alone."""
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 16, BLOCK, HKV, D, generator=gen)
    flat = cache.view(2, -1, HKV, D)
    flat[:, 0:9] = float("nan")
    flat[1, 4] = float("inf")
    q = torch.randn(2, HQ, D, generator=gen)
    meta = AttentionMetadata(torch.zeros(2, dtype=torch.long), _spans([9, 3], [0, 20]))
    out = paged_attention(q, cache, meta, 0.3)
    alone = paged_attention(q[1:], cache, AttentionMetadata(torch.zeros(1, dtype=torch.long), _spans([3], [20])), 0.3)
    assert torch.isfinite(out[1]).all()
    torch.testing.assert_close(out[1], alone[0], rtol=1e-5, atol=1e-6)
