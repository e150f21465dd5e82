"""Prefill chunks in one variable-length flash call per layer (inference_server/model/
varlen_attention.py) against a float64 reference and against the per-span SDPA path it
replaces: whole prompts, chunks after a cached prefix, one-row spans, grouped heads, head
sizes 64-256, sliding windows, rows of the spans scattered among other rows."""

from __future__ import annotations

import pytest
import torch

from loraplex.inference_server.model import attention
from loraplex.inference_server.model.attention import AttentionMetadata, SequenceSpan, paged_attention

TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
BLOCK = 16


def _case(dtype, heads, kv_heads, dim, shapes, seed=0):
    """A cache of scattered slots, queries, and the metadata of spans of (q_len, ctx_len) laid out
    as a step lays them out: each span's rows contiguous, two other rows (decodes) before them
    and three after."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    num_blocks = sum(ctx for _, ctx in shapes) // BLOCK + 9
    cache = torch.randn(2, num_blocks, BLOCK, kv_heads, dim, generator=g, device="cuda").to(dtype)
    free = torch.randperm(num_blocks * BLOCK, generator=g, device="cuda")
    spans, row, used = [], 2, 0
    for q_len, ctx in shapes:
        spans.append(SequenceSpan(row, q_len, ctx, free[used : used + ctx]))
        row, used = row + q_len, used + ctx
    q = torch.randn(row + 3, heads, dim, generator=g, device="cuda").to(dtype)
    return q, cache, AttentionMetadata(torch.zeros(row + 3, dtype=torch.long, device="cuda"), spans)


def _reference(q, cache, meta, scale, window):
    out = torch.zeros(q.shape, dtype=torch.float64, device="cuda")
    heads_kv, dim = cache.shape[3], cache.shape[4]
    keys, values = cache[0].reshape(-1, heads_kv, dim).double(), cache[1].reshape(-1, heads_kv, dim).double()
    group = q.shape[1] // heads_kv
    for s in meta.spans:
        k = keys[s.kv_slots].repeat_interleave(group, dim=1)  # [ctx, Hq, D]
        v = values[s.kv_slots].repeat_interleave(group, dim=1)
        qs = q[s.q_start : s.q_start + s.q_len].double()
        scores = torch.einsum("qhd,khd->hqk", qs, k) * scale
        pos = torch.arange(s.ctx_len - s.q_len, s.ctx_len, device="cuda")[:, None]
        key = torch.arange(s.ctx_len, device="cuda")[None, :]
        seen = key <= pos
        if window is not None:
            seen &= key > pos - window
        scores = scores.masked_fill(~seen, float("-inf"))
        out[s.q_start : s.q_start + s.q_len] = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v)
    return out


SHAPES = [(37, 37), (5, 70), (1, 33), (64, 64), (17, 300), (2, 2)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 8, 64), (32, 8, 128), (4, 1, 256), (9, 3, 64)])
@pytest.mark.parametrize("window", [None, 7])
def test_varlen_matches_the_reference_and_the_per_span_path(dtype, heads, kv_heads, dim, window, monkeypatch):
    q, cache, meta = _case(dtype, heads, kv_heads, dim, SHAPES)
    scale = dim**-0.5
    rows = slice(2, 2 + sum(s.q_len for s in meta.spans))
    want = _reference(q, cache, meta, scale, window)[rows]
    got = paged_attention(q, cache, meta, scale, window)[rows]
    assert meta.varlen is not None  # the step took the variable-length path
    torch.testing.assert_close(got.double(), want, rtol=0, atol=TOL[dtype])
    monkeypatch.setattr(attention, "VARLEN_PREFILL", False)
    per_span = paged_attention(q, cache, AttentionMetadata(meta.slot_mapping, meta.spans), scale, window)[rows]
    torch.testing.assert_close(got, per_span, rtol=0, atol=TOL[dtype])


def test_soft_capped_layers_keep_the_per_span_path():
    q, cache, meta = _case(torch.bfloat16, 8, 4, 64, SHAPES[:3])
    paged_attention(q, cache, meta, 0.125, None, softcap=30.0)
    assert meta.varlen is None
