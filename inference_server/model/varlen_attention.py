"""Prefill chunks on CUDA in one variable-length flash-attention call per layer.

The portable path (attention.py) runs one SDPA call per sequence, with two key/value gathers
each: an eager step that admits 40 short prompts beside 170 decodes made ~26 calls and ~52
gathers per layer, ~2500 launches a step (H100, max batch 256: 150-220 ms a step against ~40 ms
of device time; benchmarks/engine/eager_profile.py). Here every such span of a step goes into one
call of PyTorch's flash-attention kernel over packed rows (``cu_seq`` offsets): the keys and
values of all spans gathered once per layer, the queries gathered and the output scattered back.

Causal masking in the flash kernel is aligned to the end of the keys (a chunk's query i sits at
position ctx_len - q_len + i), which is the cache's meaning; a sliding window of W keys is
(W - 1, 0) in flash's terms. Soft-capped scores, other dtypes and head sizes past 256 keep the
portable path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_FLASH_DTYPES = (torch.float16, torch.bfloat16)
_MAX_HEAD_DIM = 256


@dataclass(frozen=True, slots=True)
class VarlenTables:
    """One step's packed layout of its portable spans (the same for every layer)."""

    q_rows: torch.Tensor  # int64 [Tq]: the spans' query rows, span after span
    kv_slots: torch.Tensor  # int64 [Tk]: the spans' cache slots, span after span
    cu_q: torch.Tensor  # int32 [N + 1]: span i's queries are packed rows cu_q[i]:cu_q[i + 1]
    cu_k: torch.Tensor  # int32 [N + 1]
    max_q: int
    max_k: int


def usable(q: torch.Tensor, softcap: float | None) -> bool:
    """Whether the flash kernel serves these queries (CUDA, 16-bit, head size <= 256, no soft-cap)."""
    dim = q.shape[-1]
    return q.is_cuda and q.dtype in _FLASH_DTYPES and dim <= _MAX_HEAD_DIM and dim % 8 == 0 and softcap is None


def build_tables(spans, device: torch.device) -> VarlenTables:
    """The packed layout of ``spans`` (attention.SequenceSpan): three small copies to the device."""
    rows: list[int] = []
    cu_q, cu_k = [0], [0]
    for s in spans:
        rows.extend(range(s.q_start, s.q_start + s.q_len))
        cu_q.append(cu_q[-1] + s.q_len)
        cu_k.append(cu_k[-1] + s.ctx_len)
    return VarlenTables(
        q_rows=torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True),
        kv_slots=torch.cat([s.kv_slots for s in spans]),
        cu_q=torch.tensor(cu_q, dtype=torch.int32).to(device, non_blocking=True),
        cu_k=torch.tensor(cu_k, dtype=torch.int32).to(device, non_blocking=True),
        max_q=max(s.q_len for s in spans),
        max_k=max(s.ctx_len for s in spans),
    )


def attend_packed(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, t: VarlenTables, scale: float,
                  window: int | None, out: torch.Tensor) -> None:
    """out[span rows] = causal attention of each span's queries over its cached keys.

    q, out: [T, Hq, D]; keys, values: the layer's cache as [slots, Hkv, D] (grouped heads are
    the kernel's own: query head h reads kv head h // (Hq / Hkv))."""
    k = keys.index_select(0, t.kv_slots)
    v = values.index_select(0, t.kv_slots)
    qs = q.index_select(0, t.q_rows)
    extra = {} if window is None else {"window_size_left": window - 1, "window_size_right": 0}
    o = torch.ops.aten._flash_attention_forward(
        qs, k, v, t.cu_q, t.cu_k, t.max_q, t.max_k, 0.0, True, False, scale=scale, **extra)[0]
    out.index_copy_(0, t.q_rows, o)
