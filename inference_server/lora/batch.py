"""Per-step LoRA metadata: segments and per-slot pointer tables, shared by every layer.

The runner orders a step's rows so that rows with the same adapter are contiguous. The
builder turns that order into segment bounds ``seg`` (int32 [S+1]), a row -> slot table,
and per-slot tables over the base family's LoRA targets (offsets into the pool, ranks, scales;
one row a target, in the order of its architecture entry: 7 for q/k/v/o/gate/up/down, 4 for
Phi-3's fused qkv/o/gate_up/down). All of them are static buffers of fixed capacity, written in
place each step (one host-to-device copy), so a captured CUDA graph stays valid. Layers call
``LoraBatch.add`` with their ``Slot`` (which fused call: q/k/v, o, gate/up, down); they never see
which kernel runs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from loraplex import kernels
from loraplex.adapter_store.format.architectures import Slot
from loraplex.inference_server.lora.resident import AdapterPlacement
from loraplex.inference_server.model.config import ModelConfig

MAX_LORA_RANK = 128
RANK_GRAIN = 16  # an eager step's workspace rank: its largest adapter rank, rounded up to this


@dataclass(slots=True)
class LoraBatch:
    """One step's LoRA view: layers call ``apply`` around each base projection (or ``add`` after it)."""

    pool: torch.Tensor
    seg: torch.Tensor  # int32 [S+1]: the step's own segments (eager), or S_cap (what a graph captures)
    row_slot: torch.Tensor  # int32 [T_cap]
    a_off: torch.Tensor  # int64 [P, S_cap], P = the family's LoRA targets
    b_off: torch.Tensor  # int64 [P, S_cap]
    ranks: torch.Tensor  # int32 [P, S_cap]
    scales: torch.Tensor  # float32 [P, S_cap]
    workspace: torch.Tensor  # [most slices a slot has, T_cap, max_rank]
    rows: dict[Slot, tuple[int, int]]  # each slot's (first table row, number of slices)
    widths: dict[Slot, tuple[int, ...]]  # each slot's slice widths
    active: frozenset[Slot]  # slots at least one segment adapts
    cache: object | None = None  # the kernels' cache across steps (loraplex.kernels.step_cache)
    side_stream: torch.cuda.Stream | None = None  # set: shrinks run there, beside the base GEMMs

    def apply(self, x: torch.Tensor, layer: int, group: Slot,
              base: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """base(x) plus the group's LoRA deltas. With a side stream, the shrink (x @ A, which
        needs only x) runs on it beside the base GEMM, and the expand joins after both."""
        if self.side_stream is None or group not in self.active:
            y = base(x)
            self.add(y, x, layer, group)
            return y
        main = torch.cuda.current_stream(x.device)
        x_ready = torch.cuda.Event()
        x_ready.record(main)
        y = base(x)
        self.side_stream.wait_event(x_ready)  # not on the GEMM: the two run side by side
        with torch.cuda.stream(self.side_stream):
            self._sgmv(y, x, layer, group, "shrink")
        main.wait_stream(self.side_stream)
        self._sgmv(y, x, layer, group, "expand")
        return y

    def add(self, y: torch.Tensor, x: torch.Tensor, layer: int, group: Slot) -> None:
        """y[:, slice p] += scale * (x @ A_p) @ B_p for each row's adapter (in place)."""
        if group in self.active:
            self._sgmv(y, x, layer, group, "both")

    def _sgmv(self, y: torch.Tensor, x: torch.Tensor, layer: int, group: Slot, stage: str) -> None:
        """SGMV over the step's segments (the CUDA decode path reads row_slot as well: the same
        launch as BGMV, which measured no faster at any batch size)."""
        kernels.add_lora_slices(y, x, self.operands(layer, group), self.seg, cache=self.cache, stage=stage,
                                row_slot=self.row_slot[: x.shape[0]])

    def operands(self, layer: int, group: Slot) -> kernels.LoraOperands:
        """The kernels' operands for ``group`` at ``layer``: its rows of the slot tables."""
        first, count = self.rows[group]
        rows = slice(first, first + count)
        return kernels.LoraOperands(self.pool, self.a_off[rows], self.b_off[rows], self.ranks[rows],
                                    self.scales[rows], layer, self.widths[group], self.workspace[:count])


class LoraBatchBuilder:
    """Owns the static table buffers; builds a LoraBatch from a step's row layout.

    The tables are views into one device byte buffer, written from one host (pinned) byte
    buffer filled through numpy: one copy per step, no per-adapter tensor ops.
    """

    def __init__(
        self, cfg: ModelConfig, pool: torch.Tensor, max_slots: int, max_rows: int, max_rank: int = MAX_LORA_RANK
    ) -> None:
        if not 1 <= max_rank <= MAX_LORA_RANK:
            raise ValueError(f"max_rank must be in [1, {MAX_LORA_RANK}], got {max_rank}")
        dev = pool.device
        self.pool = pool
        self.max_slots, self.max_rows = max_slots, max_rows
        targets = len(cfg.lora_targets)
        self.rows = cfg.architecture.slot_rows()
        self.widths = cfg.architecture.slot_widths(cfg.dims)
        layout = {"seg": (torch.int32, (max_slots + 1,)), "row_slot": (torch.int32, (max_rows,)),
                  "a_off": (torch.int64, (targets, max_slots)),
                  "b_off": (torch.int64, (targets, max_slots)),
                  "ranks": (torch.int32, (targets, max_slots)),
                  "scales": (torch.float32, (targets, max_slots))}
        self._host_bytes, host = _byte_views(layout, torch.device("cpu"), pin=dev.type == "cuda")
        self._dev_bytes, tables = _byte_views(layout, dev, pin=False)
        # recorded after each host -> device copy: the host buffer may be rewritten once it completes
        self._copied = torch.cuda.Event() if dev.type == "cuda" else None
        self._np = {name: t.numpy() for name, t in host.items()}
        self.seg, self.row_slot = tables["seg"], tables["row_slot"]
        self.a_off, self.b_off, self.ranks, self.scales = (tables[k] for k in ("a_off", "b_off", "ranks", "scales"))
        self.row_slot.fill_(-1)
        # its last dim bounds the ranks the kernels handle (and picks their prefill variant): the
        # engine's cap for captured graphs, the step's largest rank for an eager step
        slices = max(count for _, count in self.rows.values())
        self.workspace = torch.zeros(slices, max_rows, max_rank, dtype=pool.dtype, device=dev)
        self.cache = kernels.step_cache(pool)

    def pool_write_listener(self) -> Callable[[torch.Tensor, int, int, int, int], None] | None:
        """What the adapter pool must call on each write so the step cache stays true (the CPU
        decode stacks keep copies of pool rows), or None when the backend keeps no copy."""
        return None if self.cache is None else self.cache.note_write

    def build(self, rows: Sequence[tuple[int, AdapterPlacement | None]]) -> LoraBatch | None:
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
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has read the host buffer
        active = self._fill(segments, total)
        self._dev_bytes.copy_(self._host_bytes, non_blocking=self.pool.is_cuda)
        if self._copied is not None:
            self._copied.record()
        # the step's own segments: the kernels size their grids (and prefill split) by them
        return LoraBatch(
            pool=self.pool, seg=self.seg[: len(segments) + 1], row_slot=self.row_slot, a_off=self.a_off,
            b_off=self.b_off, ranks=self.ranks, scales=self.scales, workspace=self._step_workspace(len(segments)),
            rows=self.rows, widths=self.widths, active=active, cache=self.cache,
        )

    def static_batch(self, side_stream: torch.cuda.Stream | None = None) -> LoraBatch:
        """A LoraBatch over the static buffers with every projection group active: what a
        CUDA graph captures (the tables' contents, written by ``build``, pick the work).
        side_stream: run each shrink there beside its base GEMM (16-bit CUDA pools only)."""
        if side_stream is not None and not kernels.can_stage(self.workspace):
            raise ValueError(f"a LoRA side stream needs the CUDA kernels, not a {self.pool.dtype} pool on {self.pool.device}")
        return LoraBatch(
            pool=self.pool, seg=self.seg, row_slot=self.row_slot, a_off=self.a_off, b_off=self.b_off,
            ranks=self.ranks, scales=self.scales, workspace=self.workspace, rows=self.rows, widths=self.widths,
            active=frozenset(Slot), side_stream=side_stream,
        )

    def _step_workspace(self, nsegments: int) -> torch.Tensor:
        """The workspace as [slices, max_rows, R] with R the step's largest rank rounded up to
        RANK_GRAIN (a view of the same memory): an eager prefill of rank-16 adapters runs the
        kernels' rank-16 variant whatever the engine's cap. Captured graphs keep the cap."""
        full = self.workspace
        top = int(self._np["ranks"][:, :nsegments].max())
        rank = min(full.shape[2], max(RANK_GRAIN, -(-top // RANK_GRAIN) * RANK_GRAIN))
        return full.view(-1)[: full.shape[0] * full.shape[1] * rank].view(full.shape[0], full.shape[1], rank)

    def _fill(self, segments: list[tuple[int, AdapterPlacement | None]], total: int) -> frozenset[Slot]:
        """Write the host tables (the previous step's copy has completed: ``build`` waited)."""
        t = self._np
        counts = np.array([n for n, _ in segments], dtype=np.int32)
        t["seg"][0] = 0
        t["seg"][1 : len(segments) + 1] = np.cumsum(counts)
        t["seg"][len(segments) + 1 :] = total
        t["row_slot"][:total] = np.repeat(np.arange(len(segments), dtype=np.int32), counts)
        t["row_slot"][total:] = -1
        for name in ("a_off", "b_off", "ranks", "scales"):
            t[name].fill(0)
        for i, (_, place) in enumerate(segments):
            if place is not None:
                t["a_off"][:, i] = place.a_offsets
                t["b_off"][:, i] = place.b_offsets
                t["ranks"][:, i] = place.ranks
                t["scales"][:, i] = place.scales
        adapted = (t["ranks"][:, : len(segments)] > 0).any(axis=1)
        return frozenset(s for s, (first, count) in self.rows.items() if adapted[first : first + count].any())


def _byte_views(
    layout: dict[str, tuple[torch.dtype, tuple[int, ...]]], device: torch.device, pin: bool
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One byte buffer and typed views into it (each 8-byte aligned)."""
    offsets, size = {}, 0
    for name, (dtype, shape) in layout.items():
        offsets[name] = size
        size += -(-math.prod(shape) * dtype.itemsize // 8) * 8
    buf = torch.zeros(size, dtype=torch.uint8, device=device)
    if pin:
        buf = buf.pin_memory()
    views = {}
    for name, (dtype, shape) in layout.items():
        n = math.prod(shape) * dtype.itemsize
        views[name] = buf[offsets[name] : offsets[name] + n].view(dtype).view(shape)
    return buf, views


def _segments(rows: Sequence[tuple[int, AdapterPlacement | None]]) -> list[tuple[int, AdapterPlacement | None]]:
    merged: list[tuple[int, AdapterPlacement | None]] = []
    for count, place in rows:
        if merged and merged[-1][1] is place:
            merged[-1] = (merged[-1][0] + count, place)
        else:
            merged.append((count, place))
    return merged
