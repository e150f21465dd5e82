"""Paged decode attention, one device-agnostic entry point.

The CUDA kernel (``loraplex.kernels.cuda.paged_decode``: one query row per sequence over its block
table, split over the context and combined) serves 16-bit and float32 CUDA tensors of the
attention shapes it handles. Elsewhere there is no workspace, and the caller takes its
portable path (PyTorch's attention over gathered KV): ``decode_workspace`` says which, once,
when the engine is built; the engine never imports ``loraplex.kernels.cuda`` itself.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from loraplex.kernels.cuda.paged_decode import DecodeWorkspace


def _cuda():
    from loraplex.kernels.cuda import paged_decode  # noqa: PLC0415  (imports CuPy; only on CUDA devices)

    return paged_decode


def decode_workspace(dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int, max_seqs: int,
                     max_context: int, device: torch.device) -> DecodeWorkspace | None:
    """The kernel's split partials for up to ``max_seqs`` rows of up to ``max_context`` tokens,
    or None where it does not apply (not a CUDA device, or an attention shape it does not handle)."""
    if device.type != "cuda":
        return None
    cuda = _cuda()
    if not cuda.supported(dtype, head_dim, num_heads, num_kv_heads):
        return None
    return cuda.DecodeWorkspace.allocate(max_seqs, num_heads, head_dim, max_context, device)


def decode_splits(context: int) -> int:
    """Context splits the kernel uses for a step whose longest context is ``context`` tokens
    (part of the step's shape: a captured graph replays with the splits it was captured with)."""
    return _cuda().num_splits_for(context)


def decode_attention(out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     rows: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                     num_splits: int, workspace: DecodeWorkspace, window: int | None = None,
                     softcap: float | None = None) -> None:
    """out[rows[b]] = softmax(cap(scale * q[rows[b]] K_b^T)) V_b per sequence b, in place, over the
    last ``window`` keys (all: None), cap(s) = softcap * tanh(s / softcap) (none: None); see
    ``loraplex.kernels.cuda.paged_decode.paged_decode_attention`` for the shapes."""
    _cuda().paged_decode_attention(out, q, k_cache, v_cache, rows, block_tables, context_lens, scale, num_splits,
                                   workspace, window=window, softcap=softcap)
