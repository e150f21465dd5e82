"""Pack an adapter on the device: the host tier keeps PEFT's raw tensors, the device lays them out.

Packing on the CPU (``packing.pack_adapter``) is hundreds of transposed copies on the loader
thread. Here the CPU does one contiguous memcpy of the safetensors data section (plus a
small int64 table) into the host tier, and the device, after one host-to-device copy of
those bytes, runs a few batched ops that produce exactly ``pack_adapter``'s layout:

    gathered = data.view(-1, chunk)[index]            one gather: tensors in (projection, rank,
                                                      layer) order instead of the file's order
    A_p[l, :, :r] = A_l^T        B_p[l, :r, :] = (B_l * ratio_l)^T
                                                      one copy per projection and matrix when
                                                      every layer is adapted alike, else one
                                                      index_copy_ per (projection, rank) group

The gather works on chunks of ``chunk`` elements, the gcd of the tensors' sizes: the data
section holds the tensors back to back (``read_header`` checks it), so every tensor starts
and ends on a chunk boundary and the index has one entry per chunk (a 7B rank-16 adapter:
4096-element chunks, ~10k entries).
"""

from __future__ import annotations

import dataclasses
import math
import struct
import warnings
from dataclasses import dataclass

import torch

from loraplex.adapter_store.errors import AdapterValidationError
from loraplex.adapter_store.format.peft_format import WEIGHTS_FILE, AdapterSpec, LoraModuleSpec
from loraplex.adapter_store.format.safetensors_header import TensorInfo
from loraplex.inference_server.lora.pool.packing import fold_ratio
from loraplex.inference_server.lora.pool.tensor_views import TORCH_DTYPES
from loraplex.inference_server.lora.resident import AdapterLayout
from loraplex.inference_server.model.config import ModelConfig

_TABLE_ALIGN = 64  # bytes: the table starts aligned after the data section


@dataclass(frozen=True, slots=True)
class TensorGroup:
    """The modules of one projection that share one rank, in layer order."""

    proj: int  # index into the family's LoRA targets (table order)
    rank: int
    layers: tuple[int, ...]
    start: int  # element offset of the group's A tensors in the gathered buffer; its B tensors follow
    whole: bool  # every layer, in order, at the projection's rank, ratio 1: plain copies, no index
    scaled: bool  # some ratio != 1: B goes through float64, as pack_adapter does
    table: int  # int64 offset of its layer index, then its ratios (float64 bits), in the table; -1 if whole


@dataclass(frozen=True, slots=True)
class DevicePackPlan:
    """How the staged bytes of one adapter become its pool layout (see the module doc)."""

    dtype: torch.dtype  # of the source tensors
    data_start: int  # bytes: where the data section starts in the safetensors file
    data_bytes: int
    chunk: int  # elements per gathered chunk
    num_chunks: int  # the gather index is table[:num_chunks]
    table_offset: int  # bytes, into the staged buffer
    table_len: int  # int64 elements
    num_layers: int
    shapes: tuple[tuple[int, int], ...]  # (fan_in, fan_out) per LoRA target
    groups: tuple[TensorGroup, ...]
    zero_ranges: tuple[tuple[int, int], ...]  # pool elements no group writes (padding, partial projections)

    @property
    def staged_bytes(self) -> int:
        return self.table_offset + 8 * self.table_len


def plan_device_pack(
    spec: AdapterSpec, weights: bytes, layout: AdapterLayout, cfg: ModelConfig
) -> tuple[DevicePackPlan, torch.Tensor]:
    """The plan and its int64 table (gather index, then each non-whole group's layers and
    ratios) for ``weights`` (the safetensors file whose header ``spec`` was parsed from: its
    tensors are ``spec.tensors``)."""
    header = spec.tensors
    dtype = TORCH_DTYPES[spec.dtype]
    elem = dtype.itemsize
    shapes = cfg.projection_shapes()
    names = list(shapes)
    by_group: dict[tuple[int, int], list[LoraModuleSpec]] = {}
    for mod in spec.modules:
        by_group.setdefault((names.index(mod.module), mod.rank), []).append(mod)
    order: list[TensorInfo] = []
    groups: list[TensorGroup] = []
    tables: list[torch.Tensor] = []
    table_pos = pos = 0
    for (p, rank), mods in sorted(by_group.items()):
        mods.sort(key=lambda m: m.layer)
        ratios = [fold_ratio(m.scale, layout.scales[p]) for m in mods]
        layers = tuple(m.layer for m in mods)
        whole = layers == tuple(range(cfg.num_layers)) and rank == layout.ranks[p] and all(r == 1.0 for r in ratios)
        tensors = [header[m.a_name] for m in mods] + [header[m.b_name] for m in mods]
        order += tensors
        if not whole:
            tables += [torch.tensor(layers, dtype=torch.int64), torch.tensor(ratios, dtype=torch.float64).view(torch.int64)]
        groups.append(TensorGroup(p, rank, layers, pos // elem, whole, any(r != 1.0 for r in ratios),
                                  -1 if whole else table_pos))
        table_pos += 0 if whole else 2 * len(mods)
        pos += sum(t.end - t.begin for t in tensors)
    data_start = 8 + struct.unpack("<Q", weights[:8])[0]
    if pos != len(weights) - data_start:  # the gather must not read past what is staged
        raise AdapterValidationError(f"{WEIGHTS_FILE}: holds tensors that belong to none of the adapter's modules")
    index, chunk = _gather_index([(t.begin // elem, (t.end - t.begin) // elem) for t in order])
    table = torch.cat([index, *tables])
    groups = [g if g.whole else dataclasses.replace(g, table=g.table + index.numel()) for g in groups]
    plan = DevicePackPlan(
        dtype=dtype, data_start=data_start, data_bytes=pos, chunk=chunk, num_chunks=index.numel(),
        table_offset=-(-pos // _TABLE_ALIGN) * _TABLE_ALIGN, table_len=table.numel(),
        num_layers=cfg.num_layers, shapes=tuple(shapes.values()), groups=tuple(groups),
        zero_ranges=_zero_ranges(layout, groups, cfg.num_layers, shapes),
    )
    return plan, table


def _gather_index(spans: list[tuple[int, int]]) -> tuple[torch.Tensor, int]:
    """(index, chunk): gathered chunk k = data chunk index[k], for tensors (start, numel)
    listed in gathered order; chunk = gcd of the sizes (so also of the back-to-back starts)."""
    chunk = 0
    for _, n in spans:
        chunk = math.gcd(chunk, n)
    starts = torch.tensor([s for s, _ in spans], dtype=torch.int64) // chunk
    lens = torch.tensor([n for _, n in spans], dtype=torch.int64) // chunk
    dest = torch.cumsum(lens, 0) - lens
    total = int(lens.sum())
    return torch.repeat_interleave(starts - dest, lens, output_size=total) + torch.arange(total), chunk


def _zero_ranges(
    layout: AdapterLayout, groups: list[TensorGroup], num_layers: int, shapes: dict[str, tuple[int, int]]
) -> tuple[tuple[int, int], ...]:
    """Pool element ranges that no copy writes: alignment padding between blocks, and the
    whole A/B blocks of projections some group writes only partly (rank or layer subsets)."""
    partial = {g.proj for g in groups if not g.whole}
    written: list[tuple[int, int]] = []
    for p, (fan_in, fan_out) in enumerate(shapes.values()):
        rank = layout.ranks[p]
        if rank and p not in partial:
            written.append((layout.a_offsets[p], layout.a_offsets[p] + num_layers * fan_in * rank))
            written.append((layout.b_offsets[p], layout.b_offsets[p] + num_layers * rank * fan_out))
    out, pos = [], 0
    for start, end in sorted(written):
        if start > pos:
            out.append((pos, start))
        pos = end
    if pos < layout.num_elements:
        out.append((pos, layout.num_elements))
    return tuple(out)


def stage(weights: bytes, plan: DevicePackPlan, table: torch.Tensor, out: torch.Tensor) -> None:
    """Host side: the data section and the table into ``out`` (uint8, >= plan.staged_bytes),
    two contiguous copies."""
    with warnings.catch_warnings():  # read-only: the bytes are only read
        warnings.simplefilter("ignore", UserWarning)
        data = torch.frombuffer(weights, dtype=torch.uint8, count=plan.data_bytes, offset=plan.data_start)
    out[: plan.data_bytes].copy_(data)
    out[plan.table_offset : plan.staged_bytes].view(torch.int64).copy_(table)


def unpack(
    dst: torch.Tensor, staged: torch.Tensor, plan: DevicePackPlan, layout: AdapterLayout,
    scratch: torch.Tensor | None = None,
) -> None:
    """Device side: write the adapter's pool layout into ``dst`` (its pool range, any prior
    contents) from ``staged`` (``stage``'s bytes, on ``dst``'s device). Equals
    ``pack_adapter(spec, tensors, cfg, dst.dtype)`` element for element. ``scratch``: a
    uint8 buffer of >= ``plan.data_bytes`` on the device for the gathered tensors (kept by
    the caller across loads; a fresh one otherwise)."""
    data = staged[: plan.data_bytes].view(plan.dtype).view(-1, plan.chunk)
    table = staged[plan.table_offset : plan.staged_bytes].view(torch.int64)
    if scratch is None:
        scratch = torch.empty(plan.data_bytes, dtype=torch.uint8, device=dst.device)
    gathered = scratch[: plan.data_bytes].view(plan.dtype).view(-1, plan.chunk)
    torch.index_select(data, 0, table[: plan.num_chunks], out=gathered)
    gathered = gathered.view(-1)
    for start, end in plan.zero_ranges:
        dst[start:end].zero_()
    num_layers = plan.num_layers
    for g in plan.groups:
        fan_in, fan_out = plan.shapes[g.proj]
        rank, count = layout.ranks[g.proj], len(g.layers)
        a_pool = dst[layout.a_offsets[g.proj] :][: num_layers * fan_in * rank].view(num_layers, fan_in, rank)
        b_pool = dst[layout.b_offsets[g.proj] :][: num_layers * rank * fan_out].view(num_layers, rank, fan_out)
        a_end = g.start + count * g.rank * fan_in
        a = gathered[g.start : a_end].view(count, g.rank, fan_in).transpose(1, 2)
        b = gathered[a_end : a_end + count * fan_out * g.rank].view(count, fan_out, g.rank).transpose(1, 2)
        if g.whole:
            a_pool.copy_(a)
            b_pool.copy_(b)
            continue
        layers = table[g.table : g.table + count]
        if g.scaled:
            ratios = table[g.table + count : g.table + 2 * count].view(torch.float64)
            b = b.to(torch.float64) * ratios.view(count, 1, 1)
        a_pool[:, :, : g.rank].index_copy_(0, layers, a.to(dst.dtype))
        b_pool[:, : g.rank, :].index_copy_(0, layers, b.to(dst.dtype))
