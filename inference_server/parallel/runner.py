"""Rank 0's model runner: lays out the step, sends it to the workers, runs its own shard.

The scheduler, the block manager and the adapter bookkeeping above it are unchanged and
live on rank 0 only. Each step: plan (plain Python) -> broadcast the plan and any adapter
placements -> scatter the workers' adapter shards -> forward on every rank -> logits
gathered on rank 0 -> sample on rank 0.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import torch

from loraplex.inference_server.engine.block_manager import BlockManager
from loraplex.inference_server.engine.model_runner import ModelRunner, StepOutput
from loraplex.inference_server.engine.sequence import Sequence
from loraplex.inference_server.parallel.adapters import ParallelAdapterPool, ShardLoad
from loraplex.inference_server.parallel.group import leave_group
from loraplex.inference_server.parallel.layers import TensorParallelLM
from loraplex.inference_server.parallel.lora import attach_tp_lora
from loraplex.inference_server.engine.step_plan import plan_step, run_forward
from loraplex.inference_server.parallel.worker import StepMessage


class ParallelModelRunner(ModelRunner):
    """ModelRunner of rank 0 in a tensor-parallel group (``workers``: the other ranks' processes,
    None for world size 1)."""

    prompt_logprobs = False  # the workers make logits for the sampled rows only

    def __init__(
        self, model: TensorParallelLM, blocks: BlockManager, manager: ParallelAdapterPool, max_num_seqs: int,
        max_num_batched_tokens: int, workers=None,
    ) -> None:
        super().__init__(model, model.local_config, blocks, manager.pool, max_num_seqs, max_num_batched_tokens,
                         lora_attach=attach_tp_lora)
        self.why_eager = "tensor parallelism runs every step eager (no CUDA graphs, no launch-ahead)"
        self.group = model.group
        self.manager = manager
        self.workers = workers

    @torch.inference_mode()
    def execute(self, seqs: Seq[Sequence], num_tokens: Seq[int]) -> StepOutput:
        if self.workers is not None:
            self.workers.check_alive()
        plan = plan_step(seqs, num_tokens, self.blocks.block_size)
        loads = self.manager.take_loads()
        self.group.broadcast(StepMessage(plan, [(load.start, load.numel) for load in loads]))
        for load in loads:
            self._send_shards(load)
        hidden = run_forward(self.model, plan, self.kv_caches, self.lora_ctx, self.lora_builder, self.device)
        return self.outputs(plan, hidden, seqs)

    def _send_shards(self, load: ShardLoad) -> None:
        own = torch.empty(load.numel, dtype=load.shards.dtype)
        self.group.scatter_bytes(own, [load.shards[0], *load.shards.unbind(0)])

    def close(self) -> None:
        """Tell the workers to stop, wait for them (killing stragglers), leave the group."""
        if self.workers is None:
            return
        try:
            if self.workers.all_alive():
                self.group.broadcast(None)
        finally:
            self.workers.stop()
            leave_group()
            self.workers = None
