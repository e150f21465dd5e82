"""Launches of the fused decoder-layer kernels (csrc/fused_ops.cu) on PyTorch's current stream.

Shapes only decide the grids, so the calls can be captured in CUDA graphs. Callers
(kernels.fused_ops) have checked dtypes, devices and strides.
"""

from __future__ import annotations

import numpy as np
import torch

from kernels.cuda._runtime import default_cache

THREADS = 256
_DT = {torch.bfloat16: 0, torch.float16: 1}


def _p(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, out: torch.Tensor,
                 eps: float) -> None:
    rows, hidden = x.shape
    if rows == 0:
        return
    rt = default_cache().get(x.device)
    fn = rt.template_function("fused_ops.cu", f"add_rms_norm<{_DT[x.dtype]}>")
    with rt.launching():
        fn((rows,), (THREADS,), (_p(x), np.int64(x.stride(0)), _p(delta),
                                 np.int64(0 if delta is None else delta.stride(0)), _p(weight), _p(out),
                                 np.int64(out.stride(0)), np.int32(hidden), np.float32(eps)))


def rope_cache(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               slots: torch.Tensor, q_out: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    rows = qkv.shape[0]
    if rows == 0:
        return
    rt = default_cache().get(qkv.device)
    fn = rt.template_function("fused_ops.cu", f"rope_cache<{_DT[qkv.dtype]}>")
    pair_blocks = -(-(num_heads + num_kv_heads) * (head_dim // 2) // THREADS)
    v_blocks = -(-num_kv_heads * head_dim // (8 * THREADS))
    with rt.launching():
        fn((rows, pair_blocks + v_blocks), (THREADS,),
           (_p(qkv), np.int64(qkv.stride(0)), _p(positions), _p(cos), _p(sin), _p(slots), _p(q_out), _p(k_cache),
            _p(v_cache), np.int32(num_heads), np.int32(num_kv_heads), np.int32(head_dim), np.int32(pair_blocks)))


def silu_mul(gate_up: torch.Tensor, out: torch.Tensor) -> None:
    rows, width = out.shape
    if rows == 0:
        return
    rt = default_cache().get(gate_up.device)
    fn = rt.template_function("fused_ops.cu", f"silu_mul<{_DT[gate_up.dtype]}>")
    with rt.launching():
        fn((-(-width // THREADS), rows), (THREADS,), (_p(gate_up), np.int64(gate_up.stride(0)), _p(out),
                                                      np.int64(out.stride(0)), np.int32(width)))
