"""The fused decoder-layer kernels against their PyTorch expressions (kernels/fused_ops.py)
on random bf16/fp16 inputs: RoPE + cache write bitwise, norms and SiLU within one rounding."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels import fused_ops
from loraplex.inference_server.model.rope import RotaryEmbedding

DTYPES = [torch.bfloat16, torch.float16]
ULP = {torch.bfloat16: 2**-7, torch.float16: 2**-10}


def _close(a: torch.Tensor, b: torch.Tensor, dtype) -> None:
    # one rounding of a value of magnitude |b|, with a floor for values near 0
    tol = 2 * ULP[dtype] * b.float().abs().clamp_min(1.0)
    assert ((a.float() - b.float()).abs() <= tol).all()


def _rows(t: int, hidden: int, offset: int, g, dtype) -> torch.Tensor:
    """[t, hidden] random rows starting ``offset`` elements into each row of a wider buffer
    (offset 0: contiguous; odd: rows not 16-byte aligned, the kernel's scalar path)."""
    return torch.randn(t, hidden + offset, generator=g, device="cuda").to(dtype)[:, offset:]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_delta", [False, True])
@pytest.mark.parametrize("hidden,offset", [(4096, 0), (576, 0), (8192, 0), (4096, 1), (999, 0), (8200, 0)])
def test_add_rms_norm(dtype, with_delta, hidden, offset) -> None:
    """Rows in registers (hidden a multiple of 8 up to 8192, aligned) and the scalar path (the rest)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = _rows(37, hidden, offset, g, dtype)
    delta = _rows(37, hidden, offset, g, dtype) if with_delta else None
    w = (1 + 0.1 * torch.randn(hidden, generator=g, device="cuda")).to(dtype)
    ref_out, ref_x = fused_ops.add_rms_norm_reference(x.clone(), delta, w, 1e-5)
    x_fused = x.clone() if offset == 0 else x
    out = torch.full_like(ref_out, float("nan"))
    from loraplex.kernels.cuda import fused  # noqa: PLC0415

    fused.add_rms_norm(x_fused, delta, w, out, 1e-5)
    if with_delta:
        assert torch.equal(x_fused, ref_x)  # the residual stream, updated in place, rounds like PyTorch's add
    else:
        assert torch.equal(x_fused, x)
    _close(out, ref_out, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_rms_norm_returns_the_updated_residual(dtype) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(5, 4096, generator=g, device="cuda").to(dtype)
    delta = torch.randn(5, 4096, generator=g, device="cuda").to(dtype)
    ref_out, ref_x = fused_ops.add_rms_norm_reference(x.clone(), delta, torch.ones(4096, device="cuda", dtype=dtype),
                                                      1e-5)
    out, new_x = fused_ops.add_rms_norm(x, delta, torch.ones(4096, device="cuda", dtype=dtype), 1e-5)
    assert new_x.data_ptr() == x.data_ptr()  # the residual stream is updated in place
    assert torch.equal(new_x, ref_x)
    _close(out, ref_out, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("heads,kv_heads,dim", [(32, 32, 128), (9, 3, 64), (4, 2, 16), (5, 3, 12)])
@pytest.mark.parametrize("offset", [8, 3])
def test_rope_and_cache_bitwise(dtype, heads, kv_heads, dim, offset) -> None:
    """offset 8: row-strided, as a LoRA-wrapped linear's output may be; 3: v rows not 16-byte
    aligned (the element-wise copy); (5, 3, 12): a kv width that is not a multiple of 8."""
    g = torch.Generator(device="cuda").manual_seed(1)
    t = 29
    rotary = RotaryEmbedding(dim, 4096, 10000.0, None).cuda()
    qkv = _rows(t, (heads + 2 * kv_heads) * dim, offset, g, dtype)
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
