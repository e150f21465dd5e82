"""Per-step LoRA metadata: segments and per-slot pointer tables, shared by every layer.

The runner orders a step's rows so that rows with the same adapter are contiguous. The
builder turns that order into segment bounds ``seg`` (int32 [S+1]), a row -> slot table,
and per-slot tables over the 7 projections (offsets into the pool, ranks, scales). All of
them are static buffers of fixed capacity, written in place each step, so a captured
CUDA graph stays valid. Layers call ``LoraBatch.add``; they never see which kernel runs.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

import torch

import kernels
from inference_server.lora.manager import ResidentAdapter
from inference_server.lora.packing import NUM_PROJECTIONS
from inference_server.model.config import ModelConfig

MAX_LORA_RANK = 128


class ProjGroup(enum.Enum):
    """Fused projections served by one kernel launch: (first table row, number of slices)."""

    QKV = (0, 3)
    O = (3, 1)
    GATE_UP = (4, 2)
    DOWN = (6, 1)


@dataclass(slots=True)
class LoraBatch:
    """One step's LoRA view: call ``add`` after each base projection."""

    pool: torch.Tensor
    seg: torch.Tensor  # int32 [S_cap+1]
    row_slot: torch.Tensor  # int32 [T_cap]
    a_off: torch.Tensor  # int64 [7, S_cap]
    b_off: torch.Tensor  # int64 [7, S_cap]
    ranks: torch.Tensor  # int32 [7, S_cap]
    scales: torch.Tensor  # float32 [7, S_cap]
    workspace: torch.Tensor  # [3, T_cap, max_rank]
    widths: dict[ProjGroup, tuple[int, ...]]
    active: frozenset[ProjGroup]  # groups at least one slot adapts
    use_bgmv: bool

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, group: ProjGroup) -> None:
        """y[:, slice p] += scale * (x @ A_p) @ B_p for each row's adapter (in place)."""
        if group not in self.active:
            return
        first, count = group.value
        rows = slice(first, first + count)
        args = (self.pool, self.a_off[rows], self.b_off[rows], self.ranks[rows], self.scales[rows])
        workspace = self.workspace[:count]
        if self.use_bgmv:
            index = self.row_slot[: x.shape[0]]
            kernels.add_lora_slices_bgmv(y, x, *args, index, layer, self.widths[group], workspace)
        else:
            kernels.add_lora_slices(y, x, *args, self.seg, layer, self.widths[group], workspace)


class LoraBatchBuilder:
    """Owns the static table buffers; builds a LoraBatch from a step's row layout."""

    def __init__(
        self, cfg: ModelConfig, pool: torch.Tensor, max_slots: int, max_rows: int, max_rank: int = MAX_LORA_RANK
    ) -> None:
        if not 1 <= max_rank <= MAX_LORA_RANK:
            raise ValueError(f"max_rank must be in [1, {MAX_LORA_RANK}], got {max_rank}")
        dev = pool.device
        self.pool = pool
        self.max_slots, self.max_rows = max_slots, max_rows
        self.seg = torch.zeros(max_slots + 1, dtype=torch.int32, device=dev)
        self.row_slot = torch.full((max_rows,), -1, dtype=torch.int32, device=dev)
        self.a_off = torch.zeros(NUM_PROJECTIONS, max_slots, dtype=torch.int64, device=dev)
        self.b_off = torch.zeros_like(self.a_off)
        self.ranks = torch.zeros(NUM_PROJECTIONS, max_slots, dtype=torch.int32, device=dev)
        self.scales = torch.zeros(NUM_PROJECTIONS, max_slots, dtype=torch.float32, device=dev)
        # its last dim bounds the ranks the kernels handle: the smallest kernel variant that fits
        self.workspace = torch.zeros(3, max_rows, max_rank, dtype=pool.dtype, device=dev)
        self.widths = {
            ProjGroup.QKV: (cfg.q_size, cfg.kv_size, cfg.kv_size),
            ProjGroup.O: (cfg.hidden_size,),
            ProjGroup.GATE_UP: (cfg.intermediate_size, cfg.intermediate_size),
            ProjGroup.DOWN: (cfg.hidden_size,),
        }

    def build(self, rows: Sequence[tuple[int, ResidentAdapter | None]]) -> LoraBatch | None:
        """rows: (row count, adapter or None for the base model) per sequence, in batch order.

        Consecutive sequences with the same adapter share one segment. Returns None when no
        sequence uses an adapter (the step then skips LoRA entirely).
        """
        segments = _segments(rows)
        if all(ra is None for _, ra in segments):
            return None
        total = sum(n for n, _ in segments)
        if len(segments) > self.max_slots or total > self.max_rows:
            raise ValueError(f"step of {total} rows / {len(segments)} segments exceeds the LoRA table capacity")
        host = _host_tables(segments, self.max_slots)
        self._upload(host, total)
        return LoraBatch(
            pool=self.pool, seg=self.seg, row_slot=self.row_slot, a_off=self.a_off, b_off=self.b_off,
            ranks=self.ranks, scales=self.scales, workspace=self.workspace, widths=self.widths,
            active=_active_groups(host["ranks"]),
            use_bgmv=kernels.prefer_bgmv(total, len(segments)),
        )

    def static_batch(self) -> LoraBatch:
        """A LoraBatch over the static buffers with every projection group active: what a
        CUDA graph captures (the tables' contents, written by ``build``, pick the work)."""
        return LoraBatch(
            pool=self.pool, seg=self.seg, row_slot=self.row_slot, a_off=self.a_off, b_off=self.b_off,
            ranks=self.ranks, scales=self.scales, workspace=self.workspace, widths=self.widths,
            active=frozenset(ProjGroup), use_bgmv=False,
        )

    def _upload(self, host: dict[str, torch.Tensor], total: int) -> None:
        nb = self.pool.is_cuda
        self.seg.copy_(host["seg"], non_blocking=nb)
        self.row_slot[:total].copy_(host["row_slot"], non_blocking=nb)
        self.row_slot[total:].fill_(-1)
        for name in ("a_off", "b_off", "ranks", "scales"):
            getattr(self, name).copy_(host[name], non_blocking=nb)


def _segments(rows: Sequence[tuple[int, ResidentAdapter | None]]) -> list[tuple[int, ResidentAdapter | None]]:
    merged: list[tuple[int, ResidentAdapter | None]] = []
    for count, ra in rows:
        if merged and merged[-1][1] is ra:
            merged[-1] = (merged[-1][0] + count, ra)
        else:
            merged.append((count, ra))
    return merged


def _host_tables(segments: list[tuple[int, ResidentAdapter | None]], cap: int) -> dict[str, torch.Tensor]:
    seg = torch.zeros(cap + 1, dtype=torch.int32)
    a_off = torch.zeros(NUM_PROJECTIONS, cap, dtype=torch.int64)
    b_off = torch.zeros_like(a_off)
    ranks = torch.zeros(NUM_PROJECTIONS, cap, dtype=torch.int32)
    scales = torch.zeros(NUM_PROJECTIONS, cap, dtype=torch.float32)
    slots = []
    pos = 0
    for i, (count, ra) in enumerate(segments):
        pos += count
        seg[i + 1] = pos
        slots += [i] * count
        if ra is not None:
            a_off[:, i] = torch.tensor(ra.a_offsets)
            b_off[:, i] = torch.tensor(ra.b_offsets)
            ranks[:, i] = torch.tensor(ra.layout.ranks)
            scales[:, i] = torch.tensor(ra.layout.scales)
    seg[len(segments) + 1 :] = pos
    host = {"seg": seg, "row_slot": torch.tensor(slots, dtype=torch.int32)}
    host.update(a_off=a_off, b_off=b_off, ranks=ranks, scales=scales)
    return {k: (v.pin_memory() if torch.cuda.is_available() else v) for k, v in host.items()}


def _active_groups(ranks: torch.Tensor) -> frozenset[ProjGroup]:
    adapted = (ranks > 0).any(dim=1).tolist()
    return frozenset(g for g in ProjGroup if any(adapted[g.value[0] : g.value[0] + g.value[1]]))
