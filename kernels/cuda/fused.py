"""Launches of the fused decoder-layer kernels (csrc/fused_ops.cu) on PyTorch's current stream.

Shapes only decide the grids, so the calls can be captured in CUDA graphs. Callers
(loraplex.kernels.fused_ops) have checked dtypes, devices and strides.
"""

from __future__ import annotations

import numpy as np
import torch

from loraplex.kernels.cuda._runtime import default_cache

THREADS = 256
_DT = {torch.bfloat16: 0, torch.float16: 1}


def _p(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def _launch(like: torch.Tensor, kernel: str, grid: tuple[int, ...], args: tuple) -> None:
    """Launch ``kernel<DT>`` of csrc/fused_ops.cu (DT from ``like``'s dtype) on ``like``'s device."""
    rt = default_cache().get(like.device)
    fn = rt.template_function("fused_ops.cu", f"{kernel}<{_DT[like.dtype]}>")
    with rt.launching():
        fn(grid, (THREADS,), args)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, out: torch.Tensor,
                 eps: float) -> None:
    rows, hidden = x.shape
    if rows == 0:
        return
    _launch(x, "add_rms_norm", (rows,),
            (_p(x), np.int64(x.stride(0)), _p(delta), np.int64(0 if delta is None else delta.stride(0)), _p(weight),
             _p(out), np.int64(out.stride(0)), np.int32(hidden), np.float32(eps)))


def rope_cache(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               slots: torch.Tensor, q_out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    rows = qkv.shape[0]
    if rows == 0:
        return
    pair_blocks = -(-(num_heads + num_kv_heads) * (head_dim // 2) // THREADS)
    v_blocks = -(-num_kv_heads * head_dim // (8 * THREADS))
    _launch(qkv, "rope_cache", (rows, pair_blocks + v_blocks),
            (_p(qkv), np.int64(qkv.stride(0)), _p(positions), _p(cos), _p(sin), _p(slots), _p(q_out), _p(k_cache),
             _p(v_cache), np.int32(num_heads), np.int32(num_kv_heads), np.int32(head_dim), np.int32(pair_blocks)))


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor) -> None:
    rows, width = out.shape
    if rows == 0:
        return
    _launch(gate_up, "silu_mul", (-(-width // THREADS), rows),
            (_p(gate_up), np.int64(gate_up.stride(0)), _p(out), np.int64(out.stride(0)), np.int32(width)))
