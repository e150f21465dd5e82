"""The CPU SGMV backend computes exactly what the reference computes (float32 and float64)."""

from __future__ import annotations

import pytest
import torch

import kernels
from kernels import cpu, reference
from test_kernel_reference import _case


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cpu_backend_is_bitwise_the_reference(seed: int, dtype: torch.dtype) -> None:
    x, y, pool, a_off, b_off, ranks, scales, seg, widths = _case(seed)
    x, y, pool = x.to(dtype), y.to(dtype), pool.to(dtype)
    for layer in (0, 1):
        expect, got = y.clone(), y.clone()
        ws = torch.zeros(len(widths), x.shape[0] + 1, 128, dtype=dtype)
        reference.add_lora_slices(expect, x, pool, a_off, b_off, ranks, scales, seg, layer, widths, ws)
        cpu.add_lora_slices(got, x, pool, a_off, b_off, ranks, scales, seg, layer, widths, ws)
        assert torch.equal(got, expect)
        assert not torch.equal(got, y) or int(seg[-1]) == 0, "the case must add something"


def test_entry_point_takes_the_cpu_backend_for_float32_and_the_reference_for_bfloat16(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(cpu, "add_lora_slices", lambda *a: calls.append("cpu"))
    monkeypatch.setattr(reference, "add_lora_slices", lambda *a: calls.append("reference"))
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.zeros(1, 1, dtype=dtype)
        kernels.add_lora_slices(x, x, x, None, None, None, None, None, 0, (1,), None)
    assert calls == ["cpu", "reference"]
