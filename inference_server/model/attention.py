"""Attention over the paged KV cache: one step's metadata and the portable backend.

KV cache of one layer: [2, num_blocks, block_size, num_kv_heads, head_dim]. Token t of a
sequence lives in slot ``block_table[t // block_size] * block_size + t % block_size``.
A step's rows are grouped by sequence: sequence i owns rows [q_start_i, q_start_i + q_len_i)
and, after this step's keys are written, attends to its first ``ctx_len_i`` tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class SequenceSpan:
    q_start: int
    q_len: int
    ctx_len: int  # tokens in the cache after this step (including this step's)
    kv_slots: torch.Tensor  # int64 [ctx_len]: cache slots of tokens 0..ctx_len-1


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [T]: cache slot for each row's new key/value
    spans: list[SequenceSpan]


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store this step's keys/values: kv_cache[0|1].flat[slot_mapping[t]] = k|v[t]."""
    heads, dim = k.shape[1], k.shape[2]
    kv_cache[0].view(-1, heads, dim).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(-1, heads, dim).index_copy_(0, slot_mapping, v)


def paged_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached keys (GQA aware).

    q: [T, Hq, D] -> out [T, Hq, D]. Portable (CPU and CUDA); the reference for faster backends.
    """
    out = torch.empty_like(q)
    heads_kv, dim = kv_cache.shape[3], kv_cache.shape[4]
    keys = kv_cache[0].view(-1, heads_kv, dim)
    values = kv_cache[1].view(-1, heads_kv, dim)
    for span in meta.spans:
        rows = slice(span.q_start, span.q_start + span.q_len)
        k = keys.index_select(0, span.kv_slots).transpose(0, 1)  # [Hkv, ctx, D]
        v = values.index_select(0, span.kv_slots).transpose(0, 1)
        qs = q[rows].transpose(0, 1)  # [Hq, q_len, D]
        mask = _causal_mask(span, q.device) if span.q_len > 1 else None
        o = F.scaled_dot_product_attention(
            qs.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, scale=scale,
            enable_gqa=qs.shape[0] != k.shape[0],
        )
        out[rows] = o[0].transpose(0, 1)
    return out


def _causal_mask(span: SequenceSpan, device: torch.device) -> torch.Tensor:
    """Query i sits at position ctx_len - q_len + i and sees keys 0..that position."""
    q_pos = torch.arange(span.ctx_len - span.q_len, span.ctx_len, device=device)
    k_pos = torch.arange(span.ctx_len, device=device)
    return k_pos[None, :] <= q_pos[:, None]
