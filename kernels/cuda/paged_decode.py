"""Decode attention over the paged KV cache (csrc/paged_decode.cu): launch and checks.

One query row per sequence attends to its first ``context_lens[b]`` cached tokens through
its block table. Launches go on PyTorch's current stream and depend only on shapes and on
``num_splits``, so a call can be captured in a CUDA graph and replayed with new tables,
lengths and rows. Split partials live in a ``DecodeWorkspace`` the caller owns.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from loraplex.kernels.cuda._runtime import default_cache

SPLIT = 256  # PD_SPLIT: context tokens per block
THREADS = 128
MAX_GROUP = 8  # query heads per kv head handled by one block (shared-memory bound)
UNROLLS = (1, 2, 4, 8)  # tokens in flight per lane (K and V rows: 2x that many 16-byte loads)
_DT = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


def supported(dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int) -> bool:
    """Whether the kernel handles this attention shape (else callers use the portable path)."""
    if dtype not in _DT or num_kv_heads <= 0 or num_heads % num_kv_heads:
        return False
    lanes = head_dim * (4 if dtype == torch.float32 else 2) // 16
    group = num_heads // num_kv_heads
    return (head_dim * (4 if dtype == torch.float32 else 2)) % 16 == 0 and 1 <= lanes <= 32 \
        and lanes & (lanes - 1) == 0 and 1 <= group <= MAX_GROUP


def default_unroll(group: int) -> int:
    """Tokens in flight per lane: 4 where registers allow (1-2 query heads per kv head)."""
    return 4 if group <= 2 else 2


def num_splits_for(context: int) -> int:
    return max(1, -(-context // SPLIT))


@dataclass(frozen=True, slots=True)
class DecodeWorkspace:
    """fp32 split partials for up to ``max_seqs`` sequences of up to ``max_context`` tokens."""

    out: torch.Tensor  # [max_seqs * Hq * max_splits * D]
    ml: torch.Tensor  # [max_seqs * Hq * max_splits * 2]
    max_seqs: int
    max_splits: int

    @classmethod
    def allocate(cls, max_seqs: int, num_heads: int, head_dim: int, max_context: int,
                 device: torch.device) -> DecodeWorkspace:
        splits = num_splits_for(max_context)
        n = max_seqs * num_heads * splits
        return cls(torch.empty(n * head_dim, dtype=torch.float32, device=device),
                   torch.empty(n * 2, dtype=torch.float32, device=device), max_seqs, splits)


def _ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


def _check(out, q, k_cache, v_cache, rows, block_tables, context_lens, num_splits, ws) -> None:
    if q.dtype not in _DT or out.dtype != q.dtype or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q, out, k_cache, v_cache must share a dtype in {list(_DT)}")
    if q.dim() != 3 or out.shape != q.shape or q.stride(2) != 1 or q.stride(1) != q.shape[2] \
            or out.stride(2) != 1 or out.stride(1) != out.shape[2]:
        raise ValueError(f"q and out must be [T, Hq, D] with contiguous heads, got {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous [num_blocks, block_size, Hkv, D]")
    if k_cache.shape[3] != q.shape[2] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"cache {tuple(k_cache.shape)} does not fit q {tuple(q.shape)}")
    b = rows.shape[0]
    for name, t, dims in (("rows", rows, 1), ("block_tables", block_tables, 2), ("context_lens", context_lens, 1)):
        if t.dtype != torch.int32 or t.dim() != dims or t.device != q.device or t.stride(-1) != 1:
            raise ValueError(f"{name} must be an int32 tensor of {dims} dims on {q.device}, last dim contiguous")
        if t.shape[0] != b:
            raise ValueError(f"{name} has {t.shape[0]} sequences, rows has {b}")
    if not supported(q.dtype, q.shape[2], q.shape[1], k_cache.shape[2]):
        raise ValueError(f"unsupported attention shape: heads {q.shape[1]}/{k_cache.shape[2]}, head_dim {q.shape[2]}")
    if b > ws.max_seqs or not 1 <= num_splits <= ws.max_splits:
        raise ValueError(f"{b} sequences / {num_splits} splits exceed the workspace ({ws.max_seqs}, {ws.max_splits})")
    if ws.out.numel() < b * q.shape[1] * num_splits * q.shape[2]:
        raise ValueError("decode workspace is too small for these heads")


def paged_decode_attention(
    out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor,
    block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float, num_splits: int, ws: DecodeWorkspace,
    unroll: int | None = None, window: int | None = None, softcap: float | None = None,
) -> None:
    """out[rows[b]] = softmax(cap(scale * q[rows[b]] K_b^T)) V_b for each sequence b (in place).

    q, out: [T, Hq, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]; rows,
    context_lens: int32 [B]; block_tables: int32 [B, max_blocks]; every context must be
    <= num_splits * SPLIT tokens and covered by its block table (not checked: it would
    need a host sync). Rows of sequences with context 0 get zeros. unroll: tokens in flight
    per lane, one of UNROLLS (None: ``default_unroll``; other values are for benchmarks).
    window: only the last ``window`` keys of each sequence (None: all). softcap: scores become
    softcap * tanh(s / softcap) before the softmax (None: as they are).
    """
    _check(out, q, k_cache, v_cache, rows, block_tables, context_lens, num_splits, ws)
    if window is not None and window <= 0 or softcap is not None and not softcap > 0:
        raise ValueError(f"window and softcap must be > 0 (or None), got {window} and {softcap}")
    group = q.shape[1] // k_cache.shape[2]
    unroll = default_unroll(group) if unroll is None else unroll
    if unroll not in UNROLLS:
        raise ValueError(f"unroll must be one of {UNROLLS}, got {unroll}")
    b = rows.shape[0]
    if b == 0:
        return
    i32, i64 = np.int32, np.int64
    heads, heads_kv, dim = q.shape[1], k_cache.shape[2], q.shape[2]
    dt = _DT[q.dtype]
    rt = default_cache().get(q.device)
    main = rt.template_function("paged_decode.cu", f"paged_decode<{dt}, {dim}, {group}, {unroll}>")
    combine = rt.template_function("paged_decode.cu", f"paged_decode_combine<{dt}>")
    with rt.launching():
        main((b, heads_kv, num_splits), (THREADS,), (
            _ptr(q), i64(q.stride(0)), _ptr(rows), _ptr(k_cache), _ptr(v_cache), i32(heads_kv), i32(k_cache.shape[1]),
            _ptr(block_tables), i32(block_tables.stride(0)), _ptr(context_lens), np.float32(scale),
            i32(window or 0), np.float32(softcap or 0.0), _ptr(ws.out), _ptr(ws.ml), i32(num_splits)))
        combine((b, heads), (dim,), (
            _ptr(ws.out), _ptr(ws.ml), i32(num_splits), _ptr(context_lens), _ptr(rows), _ptr(out),
            i64(out.stride(0)), i32(dim)))
