"""Pack a validated PEFT adapter into the flat layout the LoRA kernels read.

For each LoRA target p of the base family (architectures.py: the 7 projections of most
families, Phi-3's 4 fused ones) that the adapter adapts, with rank r_p (the largest rank of p
over layers; layers with a smaller rank from ``rank_pattern`` are zero-padded, layers without p
are zero):

    A_p: [num_layers, in_p, r_p]   (PEFT's lora_A.weight [r, in], transposed)
    B_p: [num_layers, r_p, out_p]  (PEFT's lora_B.weight [out, r], transposed)

laid out one after the other in one flat tensor. Each projection has one scale (the
first adapted layer's, or the first non-zero one); layers whose scale differs
(``alpha_pattern``/``rank_pattern``) have the ratio folded into their B, so the kernels see
one scale per projection.

This is the reference packing, on the CPU (tensor parallelism packs every rank's shard with
it); the single-process loader packs on the device instead (``device_packing``), with the
same result element for element.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from loraplex.adapter_store.errors import AdapterValidationError
from loraplex.adapter_store.format.peft_format import AdapterSpec, LoraModuleSpec
from loraplex.inference_server.lora.resident import AdapterLayout
from loraplex.inference_server.model.config import ModelConfig

BLOCK_ALIGN = 64  # elements: every A/B block starts 128-byte aligned (bf16) for vector loads


def _aligned(n: int) -> int:
    return -(-n // BLOCK_ALIGN) * BLOCK_ALIGN


def plan_layout(spec: AdapterSpec, cfg: ModelConfig) -> AdapterLayout:
    """Compute offsets, ranks and scales from the spec alone (no tensors needed)."""
    shapes = cfg.projection_shapes()
    ranks, scales, a_offs, b_offs = [], [], [], []
    pos = 0
    for proj in shapes:  # the family's LoRA targets, in table order
        mods = [m for m in spec.modules if m.module == proj]
        rank = max((m.rank for m in mods), default=0)
        fan_in, fan_out = shapes[proj]
        ranks.append(rank)
        scales.append(next((m.scale for m in mods if m.scale != 0.0), 0.0))
        a_offs.append(pos)
        pos += _aligned(cfg.num_layers * fan_in * rank)
        b_offs.append(pos)
        pos += _aligned(cfg.num_layers * rank * fan_out)
    return AdapterLayout(tuple(ranks), tuple(scales), tuple(a_offs), tuple(b_offs), pos)


def fold_ratio(module_scale: float, scale: float) -> float:
    """The factor folded into a module's B so that its projection's one ``scale`` applies
    (``scale`` is 0 only when every module of the projection has scale 0)."""
    return 1.0 if module_scale == scale else module_scale / scale


def pack_adapter(
    spec: AdapterSpec,
    tensors: Mapping[str, torch.Tensor],
    cfg: ModelConfig,
    dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, AdapterLayout]:
    """Return the adapter as one flat tensor of ``dtype`` (on the CPU) and its layout.

    ``out``: a zeroed 1-D buffer of at least ``plan_layout(...).num_elements`` to pack into
    (a range of the host tier's arena); a new tensor otherwise."""
    layout = plan_layout(spec, cfg)
    flat = torch.zeros(layout.num_elements, dtype=dtype) if out is None else out[: layout.num_elements]
    shapes = cfg.projection_shapes()
    for p, proj in enumerate(shapes):
        mods = [m for m in spec.modules if m.module == proj]
        if mods and _uniform(mods, layout, p, cfg.num_layers):
            _write_projection(flat, layout, p, mods, tensors, shapes[proj], cfg.num_layers)
            continue
        for mod in mods:
            _write_module(flat, layout, p, mod, tensors, shapes[proj], cfg.num_layers)
    return flat, layout


def _uniform(mods: list[LoraModuleSpec], layout: AdapterLayout, p: int, num_layers: int) -> bool:
    """Every layer adapted, with the projection's rank and scale: one copy for all layers."""
    return len(mods) == num_layers and all(m.rank == layout.ranks[p] and m.scale == layout.scales[p] for m in mods)


def _write_projection(
    flat: torch.Tensor,
    layout: AdapterLayout,
    p: int,
    mods: list[LoraModuleSpec],
    tensors: Mapping[str, torch.Tensor],
    shape: tuple[int, int],
    num_layers: int,
) -> None:
    """All layers of one projection in two copies: A [L, r, in] -> [L, in, r], B [L, out, r] -> [L, r, out]."""
    fan_in, fan_out = shape
    rank = layout.ranks[p]
    mods = sorted(mods, key=lambda m: m.layer)
    a = torch.stack([_tensor(tensors, m.a_name) for m in mods])
    b = torch.stack([_tensor(tensors, m.b_name) for m in mods])
    a_all = flat[layout.a_offsets[p] : layout.a_offsets[p] + num_layers * fan_in * rank].view(num_layers, fan_in, rank)
    b_all = flat[layout.b_offsets[p] : layout.b_offsets[p] + num_layers * rank * fan_out].view(num_layers, rank, fan_out)
    a_all.copy_(a.transpose(1, 2))
    b_all.copy_(b.transpose(1, 2))


def _tensor(tensors: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    t = tensors.get(name)
    if t is None:
        raise AdapterValidationError(f"tensor {name!r} missing from the weights")
    return t


def _write_module(
    flat: torch.Tensor,
    layout: AdapterLayout,
    p: int,
    mod: LoraModuleSpec,
    tensors: Mapping[str, torch.Tensor],
    shape: tuple[int, int],
    num_layers: int,
) -> None:
    fan_in, fan_out = shape
    rank = layout.ranks[p]
    a = tensors.get(mod.a_name)
    b = tensors.get(mod.b_name)
    if a is None or b is None:
        raise AdapterValidationError(f"tensor {mod.a_name if a is None else mod.b_name!r} missing from the weights")
    a_all = flat[layout.a_offsets[p] : layout.a_offsets[p] + num_layers * fan_in * rank].view(num_layers, fan_in, rank)
    b_all = flat[layout.b_offsets[p] : layout.b_offsets[p] + num_layers * rank * fan_out].view(num_layers, rank, fan_out)
    a_all[mod.layer, :, : mod.rank] = a.t()
    ratio = fold_ratio(mod.scale, layout.scales[p])
    b_t = b.t() if ratio == 1.0 else (b.t().to(torch.float64) * ratio)
    b_all[mod.layer, : mod.rank, :] = b_t
