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

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from loraplex.inference_server.model import varlen_attention
from loraplex.kernels import paged_decode

# PyTorch's SDPA backends for the portable path on CUDA. Not cuDNN's, PyTorch's first choice on
# Hopper: it builds an execution plan for every new (query, key) shape, 50-100 ms each (up to
# 1 s) the first time a prompt length or prefix is met, while every other stream waits for that
# step (H100: 4.0-4.5 s over 40 new shapes against 7-8 ms once planned; benchmarks/engine/bench_cold_calls.py).
# Flash and memory-efficient kernels plan nothing; math is the fallback for what they refuse.
CUDA_SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
# On CUDA, a step's portable spans go through one variable-length flash call per layer
# (varlen_attention.py) where it serves them; False: one SDPA call per span (the reference).
VARLEN_PREFILL = True


def sdpa_backends(device: torch.device):
    """The context the portable path's SDPA calls run in on ``device``."""
    return sdpa_kernel(list(CUDA_SDPA_BACKENDS)) if device.type == "cuda" else contextlib.nullcontext()


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
    # portable decode tables by sliding window (None: all keys), built by the first layer that needs them
    padded: dict[int | None, tuple[torch.Tensor, ...]] = field(default_factory=dict)
    varlen: varlen_attention.VarlenTables | None = None  # likewise, for the variable-length flash path


def paged_attention(
    q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its cached keys (GQA aware).

    q: [T, Hq, D] -> out [T, Hq, D]. ``window``: a query at position p sees the keys at
    positions (p - window, p] only (a sliding-window layer); ``softcap``: scores become
    softcap * tanh(scores / softcap) before the softmax. Portable (CPU and CUDA); the reference
    for faster backends. Decode rows (one query per sequence) go through one padded, masked
    call; prefill chunks one call per sequence (on CUDA: one variable-length flash call for
    them all where it serves them, varlen_attention.py).
    """
    out = torch.empty_like(q)
    if meta.decode is not None:
        _decode_kernel(q, kv_cache, meta.decode, scale, window, softcap, out)
    if meta.spans and VARLEN_PREFILL and varlen_attention.usable(q, softcap):
        if meta.varlen is None:  # the same for every layer of the step
            meta.varlen = varlen_attention.build_tables(meta.spans, q.device)
        heads_kv, dim = kv_cache.shape[3], kv_cache.shape[4]
        varlen_attention.attend_packed(q, kv_cache[0].view(-1, heads_kv, dim), kv_cache[1].view(-1, heads_kv, dim),
                                       meta.varlen, scale, window, out)
    elif meta.spans:
        with sdpa_backends(q.device):
            _portable(q, kv_cache, meta, scale, window, softcap, out)
    return out


def _portable(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None,
              softcap: float | None, out: torch.Tensor) -> None:
    heads_kv, dim = kv_cache.shape[3], kv_cache.shape[4]
    keys = kv_cache[0].view(-1, heads_kv, dim)
    values = kv_cache[1].view(-1, heads_kv, dim)
    decodes = [s for s in meta.spans if s.q_len == 1]
    if len(decodes) > 1:
        if window not in meta.padded:  # the same for every layer of the step with this window
            meta.padded[window] = _padded_decode_tables(decodes, q.device, window)
        _decode_batch(q, keys, values, meta.padded[window], scale, softcap, out)
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
        causal = q.is_cuda and span.q_len == span.ctx_len and (window is None or span.ctx_len <= window)
        mask = _causal_mask(span, q.device, window) if not causal and (span.q_len > 1 or window) else None
        o = attend(qs.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), mask, scale, softcap,
                   causal=causal and span.q_len > 1)
        out[rows] = o[0].transpose(0, 1)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
           softcap: float | None, causal: bool = False) -> torch.Tensor:
    """softmax(scale q k^T [soft-capped], masked) v for [B, H, L, D] operands (k, v with the kv
    heads: query head h reads kv head h // (Hq / Hkv)). Soft-capping needs the scores, so it
    computes them as transformers' eager attention does; otherwise PyTorch's SDPA (on CUDA in
    ``sdpa_backends``: there the memory-efficient kernel, the one of them that takes a mask,
    takes no grouped heads, so a masked call gets the kv heads repeated)."""
    group = q.shape[1] // k.shape[1]
    if softcap is None:
        if mask is not None and group > 1 and q.is_cuda:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, is_causal=causal,
                                              enable_gqa=q.shape[1] != k.shape[1])
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(2, 3)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if causal:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril(k.shape[2] - q.shape[2])
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(weights, v)


def _decode_kernel(q: torch.Tensor, kv_cache: torch.Tensor, d: DecodeRows, scale: float, window: int | None,
                   softcap: float | None, out: torch.Tensor) -> None:
    paged_decode.decode_attention(out, q, kv_cache[0], kv_cache[1], d.rows, d.block_tables, d.context_lens,
                                  scale, d.num_splits, d.workspace, window=window, softcap=softcap)


def _padded_decode_tables(spans: list[SequenceSpan], device: torch.device,
                          window: int | None) -> tuple[torch.Tensor, ...]:
    """(slots [B, longest], mask [B, 1, 1, longest], rows [B]) of single-query sequences; with a
    window, each sequence sees its last ``window`` keys.

    A shorter sequence's padding repeats its own first slot, never another sequence's: a masked
    position's weight is 0, but 0 x inf or NaN in the values it gathers is NaN, so padding with a
    slot of another request would let one request's non-finite cache poison the others."""
    longest = max(s.ctx_len for s in spans)
    slots = torch.empty(len(spans), longest, dtype=torch.long, device=device)
    mask = torch.zeros(len(spans), 1, 1, longest, dtype=torch.bool, device=device)
    for i, span in enumerate(spans):
        slots[i, : span.ctx_len] = span.kv_slots
        slots[i, span.ctx_len :] = span.kv_slots[0]
        mask[i, ..., max(0, span.ctx_len - window) if window else 0 : span.ctx_len] = True
    return slots, mask, torch.tensor([s.q_start for s in spans], device=device)


def _decode_batch(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, padded: tuple[torch.Tensor, ...], scale: float,
    softcap: float | None, out: torch.Tensor,
) -> None:
    """One attention call for many single-query sequences: keys padded to the longest context."""
    slots, mask, rows = padded
    k = keys[slots].transpose(1, 2)  # [B, Hkv, ctx, D]
    v = values[slots].transpose(1, 2)
    qs = q[rows].unsqueeze(2)  # [B, Hq, 1, D]
    out[rows] = attend(qs, k, v, mask, scale, softcap)[:, :, 0]


def _causal_mask(span: SequenceSpan, device: torch.device, window: int | None = None) -> torch.Tensor:
    """Query i sits at position ctx_len - q_len + i and sees keys 0..that position (with a
    window, the last ``window`` of them)."""
    q_pos = torch.arange(span.ctx_len - span.q_len, span.ctx_len, device=device)
    k_pos = torch.arange(span.ctx_len, device=device)
    seen = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        seen &= k_pos[None, :] > q_pos[:, None] - window
    return seen
