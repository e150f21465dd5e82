"""Attention over the paged KV cache: one step's metadata and the portable backend.

KV cache of one layer: [2, num_blocks, block_size, num_kv_heads, head_dim]. Token t of a
sequence lives in slot ``block_table[t // block_size] * block_size + t % block_size``.
A step's rows are grouped by sequence: sequence i owns rows [q_start_i, q_start_i + q_len_i)
and, after this step's keys are written, attends to its first ``ctx_len_i`` tokens.

On CUDA, single-query (decode) sequences go to the paged decode kernel
(``loraplex.kernels.paged_decode``) through ``DecodeRows`` tensors, so the call needs no
per-sequence Python and can be captured in a CUDA graph; the other spans (prefill chunks)
and every span on the CPU use the portable SDPA path below, the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from loraplex.kernels import paged_decode


@dataclass(slots=True)
class SequenceSpan:
    q_start: int
    q_len: int
    ctx_len: int  # tokens in the cache after this step (including this step's)
    kv_slots: torch.Tensor  # int64 [ctx_len]: cache slots of tokens 0..ctx_len-1


@dataclass(slots=True)
class DecodeRows:
    """Single-query sequences served by the paged decode kernel (device tensors)."""

    rows: torch.Tensor  # int32 [B]: each sequence's query row
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    context_lens: torch.Tensor  # int32 [B]
    num_splits: int  # context split count the launch covers (>= ceil(max context / SPLIT))
    workspace: object  # loraplex.kernels.paged_decode.decode_workspace's


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # int64 [T]: cache slot for each row's new key/value
    spans: list[SequenceSpan]  # the sequences the portable path serves
    decode: DecodeRows | None = None  # the sequences the decode kernel serves (CUDA)
    padded: tuple[torch.Tensor, ...] | None = None  # portable decode tables, built by the first layer


def paged_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached keys (GQA aware).

    q: [T, Hq, D] -> out [T, Hq, D]. Portable (CPU and CUDA); the reference for faster
    backends. Decode rows (one query per sequence) go through one padded, masked call;
    prefill chunks one call per sequence.
    """
    out = torch.empty_like(q)
    if meta.decode is not None:
        _decode_kernel(q, kv_cache, meta.decode, scale, out)
    heads_kv, dim = kv_cache.shape[3], kv_cache.shape[4]
    keys = kv_cache[0].view(-1, heads_kv, dim)
    values = kv_cache[1].view(-1, heads_kv, dim)
    decodes = [s for s in meta.spans if s.q_len == 1]
    if len(decodes) > 1:
        if meta.padded is None:  # the same for every layer of the step: built once
            meta.padded = _padded_decode_tables(decodes, q.device)
        _decode_batch(q, keys, values, meta.padded, scale, out)
    else:
        decodes = []
    for span in meta.spans:
        if decodes and span.q_len == 1:
            continue
        rows = slice(span.q_start, span.q_start + span.q_len)
        k = keys.index_select(0, span.kv_slots).transpose(0, 1)  # [Hkv, ctx, D]
        v = values.index_select(0, span.kv_slots).transpose(0, 1)
        qs = q[rows].transpose(0, 1)  # [Hq, q_len, D]
        # a whole prompt on CUDA: the built-in causal mask (flash kernels); else explicit
        causal = q.is_cuda and span.q_len == span.ctx_len
        mask = _causal_mask(span, q.device) if span.q_len > 1 and not causal else None
        o = F.scaled_dot_product_attention(
            qs.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask, scale=scale,
            is_causal=causal and span.q_len > 1, enable_gqa=qs.shape[0] != k.shape[0],
        )
        out[rows] = o[0].transpose(0, 1)
    return out


def _decode_kernel(q: torch.Tensor, kv_cache: torch.Tensor, d: DecodeRows, scale: float, out: torch.Tensor) -> None:
    paged_decode.decode_attention(out, q, kv_cache[0], kv_cache[1], d.rows, d.block_tables, d.context_lens,
                                     scale, d.num_splits, d.workspace)


def _padded_decode_tables(spans: list[SequenceSpan], device: torch.device) -> tuple[torch.Tensor, ...]:
    """(slots [B, longest], mask [B, 1, 1, longest], rows [B]) of single-query sequences.

    A shorter sequence's padding repeats its own first slot, never another sequence's: a masked
    position's weight is 0, but 0 x inf or NaN in the values it gathers is NaN, so padding with a
    slot of another request would let one request's non-finite cache poison the others."""
    longest = max(s.ctx_len for s in spans)
    slots = torch.empty(len(spans), longest, dtype=torch.long, device=device)
    mask = torch.zeros(len(spans), 1, 1, longest, dtype=torch.bool, device=device)
    for i, span in enumerate(spans):
        slots[i, : span.ctx_len] = span.kv_slots
        slots[i, span.ctx_len :] = span.kv_slots[0]
        mask[i, ..., : span.ctx_len] = True
    return slots, mask, torch.tensor([s.q_start for s in spans], device=device)


def _decode_batch(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, padded: tuple[torch.Tensor, ...], scale: float,
    out: torch.Tensor,
) -> None:
    """One SDPA call for many single-query sequences: keys padded to the longest context."""
    slots, mask, rows = padded
    k = keys[slots].transpose(1, 2)  # [B, Hkv, ctx, D]
    v = values[slots].transpose(1, 2)
    qs = q[rows].unsqueeze(2)  # [B, Hq, 1, D]
    o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=qs.shape[1] != k.shape[1])
    out[rows] = o[:, :, 0]


def _causal_mask(span: SequenceSpan, device: torch.device) -> torch.Tensor:
    """Query i sits at position ctx_len - q_len + i and sees keys 0..that position."""
    q_pos = torch.arange(span.ctx_len - span.q_len, span.ctx_len, device=device)
    k_pos = torch.arange(span.ctx_len, device=device)
    return k_pos[None, :] <= q_pos[:, None]
