"""The paged decode kernel's argument checks and shape support, without a GPU: bad
arguments are a ValueError naming the problem before anything is launched."""

from __future__ import annotations

import pytest
import torch

from loraplex.kernels.cuda.paged_decode import (
    UNROLLS, DecodeWorkspace, default_unroll, num_splits_for, paged_decode_attention, supported,
)


def test_supported_shapes() -> None:
    assert supported(torch.bfloat16, 128, 32, 32)  # Llama-2-7B
    assert supported(torch.bfloat16, 64, 9, 3)  # SmolLM2-135M
    assert supported(torch.float32, 128, 32, 8)
    assert supported(torch.bfloat16, 16, 4, 2)
    assert not supported(torch.bfloat16, 128, 32, 1)  # 32 query heads per kv head: over MAX_GROUP
    assert not supported(torch.bfloat16, 80, 32, 32)  # 10 lanes per token: not a power of two
    assert not supported(torch.float32, 256, 8, 8)  # 64 lanes per token
    assert not supported(torch.bfloat16, 128, 6, 4)  # heads not a multiple of kv heads
    assert not supported(torch.int8, 128, 8, 8)


def test_default_unroll_keeps_registers_for_wide_groups() -> None:
    assert default_unroll(1) == 4 and default_unroll(3) == 2 and default_unroll(8) in UNROLLS


def test_num_splits() -> None:
    assert [num_splits_for(n) for n in (0, 1, 256, 257, 2048)] == [1, 1, 1, 2, 8]


def _args(**over):
    args = dict(
        out=torch.zeros(4, 8, 64, dtype=torch.bfloat16), q=torch.zeros(4, 8, 64, dtype=torch.bfloat16),
        k_cache=torch.zeros(10, 16, 2, 64, dtype=torch.bfloat16), v_cache=torch.zeros(10, 16, 2, 64, dtype=torch.bfloat16),
        rows=torch.arange(3, dtype=torch.int32), block_tables=torch.zeros(3, 4, dtype=torch.int32),
        context_lens=torch.ones(3, dtype=torch.int32), scale=0.125, num_splits=1,
        ws=DecodeWorkspace(torch.zeros(3 * 8 * 2 * 64), torch.zeros(3 * 8 * 2 * 2), 3, 2),
    )
    args.update(over)
    return args


@pytest.mark.parametrize("over,message", [
    (dict(q=torch.zeros(4, 8, 64, dtype=torch.float16)), "share a dtype"),
    (dict(q=torch.zeros(4, 512, dtype=torch.bfloat16)), r"\[T, Hq, D\]"),
    (dict(k_cache=torch.zeros(10, 16, 2, 32, dtype=torch.bfloat16)), "k_cache and v_cache"),
    (dict(k_cache=torch.zeros(10, 16, 3, 64, dtype=torch.bfloat16), v_cache=torch.zeros(10, 16, 3, 64, dtype=torch.bfloat16)),
     "does not fit"),
    (dict(rows=torch.arange(3)), "rows must be an int32"),
    (dict(block_tables=torch.zeros(2, 4, dtype=torch.int32)), "block_tables has 2 sequences"),
    (dict(context_lens=torch.ones(3, 1, dtype=torch.int32)), "context_lens must be an int32 tensor of 1 dims"),
    (dict(num_splits=3), "exceed the workspace"),
    (dict(num_splits=0), "exceed the workspace"),
    (dict(unroll=3), "unroll must be one of"),
])
def test_bad_arguments_are_named(over, message) -> None:
    with pytest.raises(ValueError, match=message):
        paged_decode_attention(**_args(**over))
