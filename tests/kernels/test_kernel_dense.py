"""loraplex.kernels.linear: x @ W^T + b, the few-rows CPU form within float32 rounding of F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loraplex import kernels
from loraplex.kernels import dense


@pytest.mark.parametrize("rows", [1, 2, 3, 8, 17, 64, 65, 200])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_equals_f_linear_within_rounding(rows: int, with_bias: bool) -> None:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen)
    w = torch.randn(160, 96, generator=gen) * 0.1
    b = torch.randn(160, generator=gen) if with_bias else None
    got = kernels.linear(x, w, b)
    expect = F.linear(x, w, b)
    assert got.shape == expect.shape and got.is_contiguous() and got.dtype == x.dtype
    torch.testing.assert_close(got, expect, rtol=1e-5, atol=1e-5)


def test_linear_takes_a_strided_input_row_slice() -> None:
    x = torch.randn(8, 200)[:, 10:106]
    w = torch.randn(32, 96)
    torch.testing.assert_close(kernels.linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_other_dtypes_are_f_linear_bitwise(dtype: torch.dtype) -> None:
    x, w = torch.randn(8, 64).to(dtype), torch.randn(32, 64).to(dtype)
    assert torch.equal(kernels.linear(x, w), F.linear(x, w))


def test_more_rows_than_few_take_f_linear_bitwise() -> None:
    x, w = torch.randn(dense.FEW_ROWS + 1, 64), torch.randn(32, 64)
    assert torch.equal(kernels.linear(x, w), F.linear(x, w))
