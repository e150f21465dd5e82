"""A worker rank (1..N-1): its model shard, KV cache shard and adapter pool, driven by rank 0.

It holds no scheduler and no adapter bookkeeping: each step rank 0 broadcasts a
``StepMessage``; the worker copies the adapter shards it is sent into its pool, runs the same
forward as rank 0, and takes part in the logits gather. ``None`` means stop.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from loraplex.inference_server.lora.batch import LoraBatchBuilder
from loraplex.inference_server.lora.layers import LoraContext
from loraplex.inference_server.model.config import ModelConfig
from loraplex.inference_server.parallel.group import TPGroup
from loraplex.inference_server.parallel.layers import TensorParallelLM
from loraplex.inference_server.parallel.lora import attach_tp_lora
from loraplex.inference_server.engine.step_plan import StepPlan, run_forward

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StepMessage:
    """What rank 0 broadcasts before each step: the plan and the adapter shards that follow
    (``loads``: (pool offset, elements) per scattered shard, in order)."""

    plan: StepPlan
    loads: list[tuple[int, int]]


def make_kv_caches(
    cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: str | torch.device
) -> list[torch.Tensor]:
    """One [2, blocks, block_size, kv heads, head_dim] cache per layer (``cfg``: the rank's shapes)."""
    shape = (2, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_layers)]


class TensorParallelWorker:
    def __init__(
        self, model: TensorParallelLM, group: TPGroup, num_blocks: int, block_size: int, pool_elements: int,
        dtype: torch.dtype, max_num_seqs: int, max_num_batched_tokens: int,
    ) -> None:
        local = model.local_config
        self.model = model
        self.group = group
        self.device = torch.device(group.device)
        self.kv_caches = make_kv_caches(local, num_blocks, block_size, dtype, self.device)
        self.pool = torch.zeros(pool_elements, dtype=dtype, device=self.device)
        self.lora_ctx = LoraContext()
        attach_tp_lora(model, self.lora_ctx)
        self.lora_builder = LoraBatchBuilder(local, self.pool, max_num_seqs, max_num_batched_tokens)

    def serve(self) -> None:
        """Run steps until rank 0 says stop (returns) or a collective fails (raises)."""
        while True:
            message: StepMessage | None = self.group.broadcast(None)
            if message is None:
                return
            self._load(message.loads)
            self._step(message.plan)

    def _load(self, loads: list[tuple[int, int]]) -> None:
        for start, numel in loads:
            shard = torch.empty(numel, dtype=self.pool.dtype)
            self.group.scatter_bytes(shard)
            self.pool[start : start + numel].copy_(shard)

    @torch.inference_mode()
    def _step(self, plan: StepPlan) -> None:
        hidden = run_forward(self.model, plan, self.kv_caches, self.lora_ctx, self.lora_builder, self.device)
        if plan.sample_rows:
            self.model.compute_logits(hidden[torch.tensor(plan.sample_rows, device=self.device)])
