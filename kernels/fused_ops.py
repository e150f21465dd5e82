"""Decoder-layer element-wise ops: the PyTorch reference, and fused CUDA kernels.

On 16-bit CUDA tensors each op is one kernel (``loraplex.kernels.cuda.fused``, csrc/fused_ops.cu)
instead of the several launches of its PyTorch expression, rounding where the expression
does. Everything else (CPU, and float32 on CUDA: the exactness mode) runs the PyTorch
expressions below, which define the semantics (the Hugging Face Llama order of operations).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_FUSED_DTYPES = (torch.bfloat16, torch.float16)


def _fused(t: torch.Tensor) -> bool:
    return t.is_cuda and t.dtype in _FUSED_DTYPES


def _cuda():
    from loraplex.kernels.cuda import fused  # noqa: PLC0415  (imports CuPy: CUDA only)

    return fused


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(RMSNorm(x'), x') with x' = x + delta (x when delta is None); x: [T, H].

    RMSNorm(v) = weight * (v in float32 * rsqrt(mean(v^2) + eps)).to(v.dtype). The fused
    path updates x in place to x' (the residual stream) and returns it.
    """
    if _fused(x) and x.stride(-1) == 1 and (delta is None or delta.stride(-1) == 1):
        out = torch.empty_like(x)
        _cuda().add_rms_norm(x, delta, weight, out, eps)
        return out, x
    return add_rms_norm_reference(x, delta, weight, eps)


def add_rms_norm_reference(x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if delta is not None:
        x = x + delta
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype), x


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_and_cache(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   kv_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                   head_dim: int) -> torch.Tensor:
    """Rotate q and k of the fused rows qkv [T, (Hq + 2 Hkv) D] (RoPE: x cos + rotate_half(x) sin,
    cos/sin [P, D] float32 rounded to x's dtype), store k and v at ``slot_mapping`` of the
    layer's cache [2, blocks, block_size, Hkv, D], return q [T, Hq, D]."""
    if _fused(qkv) and qkv.stride(-1) == 1 and kv_cache.is_contiguous():
        q = torch.empty(qkv.shape[0], num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
        _cuda().rope_cache(qkv, positions, cos, sin, slot_mapping, q, kv_cache[0], kv_cache[1], num_heads,
                           num_kv_heads, head_dim)
        return q
    return rope_and_cache_reference(qkv, positions, cos, sin, kv_cache, slot_mapping, num_heads, num_kv_heads,
                                    head_dim)


def rope_and_cache_reference(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                             kv_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                             head_dim: int) -> torch.Tensor:
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(-1, num_heads, head_dim)
    k = k.view(-1, num_kv_heads, head_dim)
    v = v.reshape(-1, num_kv_heads, head_dim)
    c = cos[positions].to(q.dtype)[:, None, :]
    s = sin[positions].to(q.dtype)[:, None, :]
    q, k = q * c + rotate_half(q) * s, k * c + rotate_half(k) * s
    kv_cache[0].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)
    return q


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up of the fused rows [gate | up] (each half the width)."""
    width = gate_up.shape[-1] // 2
    if _fused(gate_up) and gate_up.stride(-1) == 1:
        out = torch.empty(gate_up.shape[0], width, dtype=gate_up.dtype, device=gate_up.device)
        _cuda().silu_mul(gate_up, out)
        return out
    return silu_and_mul_reference(gate_up)


def silu_and_mul_reference(gate_up: torch.Tensor) -> torch.Tensor:
    width = gate_up.shape[-1] // 2
    gate, up = gate_up.split(width, dim=-1)
    return F.silu(gate) * up
