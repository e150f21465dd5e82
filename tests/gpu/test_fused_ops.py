"""The fused decoder-layer kernels against their PyTorch expressions (kernels/fused_ops.py)
on random bf16/fp16 inputs: RoPE + cache write bitwise, norms and SiLU within one rounding."""

from __future__ import annotations

import pytest
import torch

from kernels import fused_ops
from inference_server.model.rope import RotaryEmbedding

DTYPES = [torch.bfloat16, torch.float16]
ULP = {torch.bfloat16: 2**-7, torch.float16: 2**-10}


def _close(a: torch.Tensor, b: torch.Tensor, dtype) -> None:
    # one rounding of a value of magnitude |b|, with a floor for values near 0
    tol = 2 * ULP[dtype] * b.float().abs().clamp_min(1.0)
    assert ((a.float() - b.float()).abs() <= tol).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm(dtype, with_delta) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(37, 4096, generator=g, device="cuda").to(dtype)
    delta = torch.randn(37, 4096, generator=g, device="cuda").to(dtype) if with_delta else None
    w = (1 + 0.1 * torch.randn(4096, generator=g, device="cuda")).to(dtype)
    ref_out, ref_x = fused_ops.add_rms_norm_reference(x.clone(), delta, w, 1e-5)
    x_fused = x.clone()
    out, new_x = fused_ops.add_rms_norm(x_fused, delta, w, 1e-5)
    assert new_x.data_ptr() == x_fused.data_ptr()  # the residual stream is updated in place
    assert torch.equal(new_x, ref_x)  # the add rounds exactly like PyTorch's
    _close(out, ref_out, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads,kv_heads,dim", [(32, 32, 128), (9, 3, 64), (4, 2, 16)])
def test_rope_and_cache_bitwise(dtype, heads, kv_heads, dim) -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    t = 29
    rotary = RotaryEmbedding(dim, 4096, 10000.0, None).cuda()
    qkv_full = torch.randn(t, (heads + 2 * kv_heads) * dim + 8, generator=g, device="cuda").to(dtype)
    qkv = qkv_full[:, 8:]  # row-strided, as a LoRA-wrapped linear's output may be
    positions = torch.randint(0, 4000, (t,), generator=g, device="cuda")
    slots = torch.randperm(64 * 16, generator=g, device="cuda")[:t]
    caches = [torch.zeros(2, 64, 16, kv_heads, dim, dtype=dtype, device="cuda") for _ in range(2)]
    q_ref = fused_ops.rope_and_cache_reference(qkv, positions, rotary.cos, rotary.sin, caches[0], slots, heads,
                                               kv_heads, dim)
    q = fused_ops.rope_and_cache(qkv, positions, rotary.cos, rotary.sin, caches[1], slots, heads, kv_heads, dim)
    assert torch.equal(q, q_ref)
    assert torch.equal(caches[1], caches[0])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul(dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(2)
    gate_up = (3 * torch.randn(33, 2 * 11008, generator=g, device="cuda")).to(dtype)
    _close(fused_ops.silu_and_mul(gate_up), fused_ops.silu_and_mul_reference(gate_up), dtype)
