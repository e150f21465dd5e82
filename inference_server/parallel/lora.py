"""LoRA under tensor parallelism, as S-LoRA shards it, with no communication of its own.

Column-parallel projections (q/k/v, gate/up): A replicated, B split by output columns. Every
rank computes the same v = x @ A [T, r] and its own columns v @ B_r: no communication.

Row-parallel projections (o, down): A split by input rows, B replicated. The exact delta is
(sum_r x_r @ A_r) @ B. S-LoRA all-reduces the shrink v = sum_r x_r @ A_r ([T, r], small),
then every rank expands v @ B and adds it after the base all-reduce: two collectives per
projection. Because the expand is linear, sum_r (x_r @ A_r) @ B = (sum_r x_r @ A_r) @ B, so
each rank instead adds its *partial* delta (x_r @ A_r) @ B to its *partial* base output and
the base layer's one all-reduce sums both. Same FLOPs as S-LoRA (every rank expands with the
full B in both designs), one collective instead of two, and the [T, H] message is the one
the base layer sends anyway: the LoRA path costs zero extra communication.

The pool, the segment tables and the kernels are unchanged: each rank's pool holds its
shards laid out for the per-rank shapes (``local_config``), and because every rank has the
same shapes, one layout (one set of offsets) is valid on every rank.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from loraplex.adapter_store.format.architectures import COLUMN_PARALLEL
from loraplex.adapter_store.format.peft_format import AdapterSpec
from loraplex.inference_server.lora.layers import LoraContext, LoraLinear, wrap_sites
from loraplex.inference_server.lora.pool.packing import pack_adapter, plan_layout
from loraplex.inference_server.lora.resident import AdapterLayout
from loraplex.inference_server.model.config import ModelConfig
from loraplex.inference_server.parallel.layers import RowParallelLinear
from loraplex.inference_server.parallel.shard import local_config


class RowParallelLoraLinear(LoraLinear):
    """y = all_reduce(x_r @ W_r^T + scale * (x_r @ A_r) @ B): base and LoRA partials, one reduce."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base.partial(x)
        batch = self.ctx.batch
        if batch is not None:
            batch.add(y, x, self.layer, self.group)
        return self.base.group.all_reduce(y)


def attach_tp_lora(model: nn.Module, ctx: LoraContext) -> None:
    """Wrap a sharded model's projections: plain LoraLinear on column-parallel ones, the
    reduce-sharing wrapper on row-parallel ones (the ModelRunner's ``lora_attach`` hook)."""
    wrap_sites(model.lora_sites(), ctx,
               lambda base: RowParallelLoraLinear if isinstance(base, RowParallelLinear) else LoraLinear)


def shard_adapter_tensors(
    spec: AdapterSpec, tensors: Mapping[str, torch.Tensor], cfg: ModelConfig, rank: int, world_size: int
) -> dict[str, torch.Tensor]:
    """Rank's PEFT tensors (A [r, in], B [out, r]): column-parallel targets slice each output part
    of B (q, k, v of a fused qkv_proj each), row-parallel ones A's columns; the other matrix is
    replicated."""
    dims, local = cfg.dims, local_config(cfg, world_size).dims
    out: dict[str, torch.Tensor] = {}
    for mod in spec.modules:
        a, b = tensors[mod.a_name], tensors[mod.b_name]
        target = cfg.architecture.target(mod.module)
        if target.slot in COLUMN_PARALLEL:
            rows, start = [], 0
            for part in target.parts:
                size = local.size(part)
                rows.append(b.narrow(0, start + rank * size, size))
                start += dims.size(part)
            out[mod.a_name], out[mod.b_name] = a, torch.cat(rows) if len(rows) > 1 else rows[0]
        else:
            size = local.size(target.fan_in)
            out[mod.a_name], out[mod.b_name] = a.narrow(1, rank * size, size), b
    return out


def shard_layout(spec: AdapterSpec, cfg: ModelConfig, world_size: int) -> AdapterLayout:
    """The pool layout of one rank's shard (identical on every rank)."""
    return plan_layout(spec, local_config(cfg, world_size))


def pack_shards(
    spec: AdapterSpec, tensors: Mapping[str, torch.Tensor], cfg: ModelConfig, world_size: int, dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, AdapterLayout]:
    """Every rank's packed shard, one after the other: flat [world_size * n], n = layout size.

    ``out``: a zeroed buffer of at least world_size * n elements (the host tier's range)."""
    local = local_config(cfg, world_size)
    layout = plan_layout(spec, local)
    n = layout.num_elements
    flat = torch.zeros(world_size * n, dtype=dtype) if out is None else out[: world_size * n]
    for rank in range(world_size):
        shard = shard_adapter_tensors(spec, tensors, cfg, rank, world_size)
        pack_adapter(spec, shard, local, dtype, out=flat[rank * n : (rank + 1) * n])
    return flat, layout
