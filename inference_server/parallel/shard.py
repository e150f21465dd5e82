"""Which slice of every weight a rank keeps, and sharding a built model from outside.

Megatron layout over W ranks (rank r):

Every family's model has the same fused modules (model/layers.py); the checkpoint's tensors are
sliced by the family's LoRA target table (a fused ``qkv_proj`` in the checkpoint, as Phi-3's,
part by part):

- q/k/v (fused ``qkv_proj``) column-parallel: rank r keeps query heads
  [r*Hq/W, (r+1)*Hq/W) and kv heads [r*Hkv/W, (r+1)*Hkv/W), fused as [q_r; k_r; v_r].
  GQA groups stay whole: query head j uses kv head j // (Hq/Hkv), on the same rank.
- gate/up (fused ``gate_up_proj``) column-parallel: [gate_r; up_r], intermediate/W rows each.
- o_proj and down_proj row-parallel: the matching input columns; outputs all-reduced.
- embed_tokens and lm_head split over the vocabulary (ceil(V/W) rows each, the last shard
  zero-padded); embeddings all-reduced, logits gathered on rank 0.
- norms and rotary tables replicated; the KV cache holds the rank's kv heads only.

Requires num_kv_heads (hence num_heads) and intermediate_size divisible by W; KV-head
replication (W > num_kv_heads) is not supported and is refused with a clear error.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from loraplex.adapter_store.format.architectures import COLUMN_PARALLEL
from loraplex.inference_server.model.config import ModelConfig
from loraplex.inference_server.model.weights import fuse_hf_tensors, load_state, new_model
from loraplex.inference_server.parallel.group import TPGroup
from loraplex.inference_server.parallel.layers import RowParallelLinear, TensorParallelLM, VocabParallelEmbedding

_HF_PROJ = re.compile(r"^model\.layers\.\d+\.(?:self_attn|mlp)\.(\w+)\.(weight|bias)$")


def local_config(cfg: ModelConfig, world_size: int) -> ModelConfig:
    """The per-rank shapes: heads, kv heads and intermediate size divided by ``world_size``."""
    if world_size < 1:
        raise ValueError(f"tensor-parallel size must be >= 1, got {world_size}")
    if cfg.num_kv_heads % world_size:
        raise ValueError(
            f"tensor-parallel size {world_size} does not divide the model's {cfg.num_kv_heads} KV heads: the KV "
            f"cache is sharded by KV head, so use a size that divides {cfg.num_kv_heads} (KV-head replication is "
            "not supported)"
        )
    if cfg.intermediate_size % world_size:
        raise ValueError(
            f"tensor-parallel size {world_size} does not divide the MLP intermediate size {cfg.intermediate_size}"
        )
    return dataclasses.replace(
        cfg, num_heads=cfg.num_heads // world_size, num_kv_heads=cfg.num_kv_heads // world_size,
        intermediate_size=cfg.intermediate_size // world_size,
    )


def vocab_range(vocab_size: int, rank: int, world_size: int) -> tuple[int, int, int]:
    """(first id, end id, rows per shard) of ``rank``'s vocabulary shard."""
    per = -(-vocab_size // world_size)
    start = min(rank * per, vocab_size)
    return start, min(start + per, vocab_size), per


def _rows(t: torch.Tensor, dim: int, size: int, rank: int, offset: int = 0) -> torch.Tensor:
    return t.narrow(dim, offset + rank * size, size)


def _vocab_rows(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    start, end, per = vocab_range(t.shape[0], rank, world_size)
    out = t.new_zeros((per, *t.shape[1:]))
    out[: end - start] = t[start:end]
    return out


def shard_hf_tensor(name: str, t: torch.Tensor, cfg: ModelConfig, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s slice of one Hugging Face tensor (HF layout: linear weights [out, in])."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return _vocab_rows(t, rank, world_size)
    m = _HF_PROJ.match(name)
    if m is None or m.group(1) not in cfg.architecture.target_modules:
        return t  # norms (q/k norms too, per head): replicated
    proj, kind = m.groups()
    target = cfg.architecture.target(proj)
    if target.slot in COLUMN_PARALLEL:  # each output part (q, k, v of a fused qkv_proj) split by rows
        return _fused_rows(t, [cfg.dims.size(part) for part in target.parts], rank, world_size).clone()
    if kind == "weight":
        return _rows(t, 1, local_config(cfg, world_size).dims.size(target.fan_in), rank).clone()
    raise ValueError(f"no tensor-parallel rule for checkpoint tensor {name!r} (a row-parallel projection's bias)")


def shard_hf_tensors(
    tensors: Iterable[tuple[str, torch.Tensor]], cfg: ModelConfig, rank: int, world_size: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream of (name, rank's slice): every full tensor is dropped as soon as it is sliced."""
    for name, t in tensors:
        yield name, shard_hf_tensor(name, t, cfg, rank, world_size)


def _fused_rows(t: torch.Tensor, sizes: list[int], rank: int, world_size: int) -> torch.Tensor:
    """Rank's rows of each part of a fused [part0; part1; ...] tensor, fused again."""
    parts, offset = [], 0
    for size in sizes:
        parts.append(_rows(t, 0, size // world_size, rank, offset))
        offset += size
    return torch.cat(parts, dim=0)


def _param(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.contiguous(), requires_grad=False)


def shard_model(model: nn.Module, group: TPGroup) -> TensorParallelLM:
    """Shard a built (or meta) Llama-family model in place for ``group``'s rank and wrap it.

    Slices every weight to the rank's shard (on the meta device only shapes change), swaps in
    vocab-parallel embeddings and row-parallel o/down projections, and sets each attention's
    head counts to the rank's. Returns the wrapper whose ``compute_logits`` gathers the vocab.
    """
    cfg, rank, world = model.config, group.rank, group.world_size
    local = local_config(cfg, world)
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        qkv = attn.qkv_proj
        qkv.weight = _param(_fused_rows(qkv.weight, [cfg.q_size, cfg.kv_size, cfg.kv_size], rank, world))
        if qkv.bias is not None:
            qkv.bias = _param(_fused_rows(qkv.bias, [cfg.q_size, cfg.kv_size, cfg.kv_size], rank, world))
        qkv.out_features = local.q_size + 2 * local.kv_size
        attn.num_heads, attn.num_kv_heads = local.num_heads, local.num_kv_heads
        attn.q_size, attn.kv_size = local.q_size, local.kv_size
        attn.o_proj = RowParallelLinear.from_linear(attn.o_proj, _rows(attn.o_proj.weight, 1, local.q_size, rank), group)
        gate_up = mlp.gate_up_proj
        gate_up.weight = _param(_fused_rows(gate_up.weight, [cfg.intermediate_size] * 2, rank, world))
        gate_up.out_features = 2 * local.intermediate_size
        mlp.intermediate = local.intermediate_size
        down = _rows(mlp.down_proj.weight, 1, local.intermediate_size, rank)
        mlp.down_proj = RowParallelLinear.from_linear(mlp.down_proj, down, group)
    start, end, _ = vocab_range(cfg.vocab_size, rank, world)
    model.embed_tokens = VocabParallelEmbedding.from_weight(
        _vocab_rows(model.embed_tokens.weight, rank, world), start, end, group)
    if model.lm_head is not None:
        head = nn.Linear(cfg.hidden_size, end - start, bias=False, device="meta")
        head.weight = _param(_vocab_rows(model.lm_head.weight, rank, world))
        head.out_features = head.weight.shape[0]
        model.lm_head = head
    return TensorParallelLM(model, group, local)


def load_sharded_model(
    cfg: ModelConfig, tensors: Iterable[tuple[str, torch.Tensor]], device: str, dtype: torch.dtype, group: TPGroup
) -> TensorParallelLM:
    """Build on the meta device, shard from outside, then load only this rank's slices
    (each full tensor is read, sliced and dropped; the rank never holds the whole model)."""
    model = new_model(cfg)
    tp = shard_model(model, group)
    state = fuse_hf_tensors(shard_hf_tensors(tensors, cfg, group.rank, group.world_size), device, dtype, cfg)
    load_state(model, state, cfg)
    model.init_rotary(device)
    model.eval().requires_grad_(False)
    return tp.eval()
