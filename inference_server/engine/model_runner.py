"""The one object that owns the device: model, KV cache, LoRA tables; runs one step.

Everything above it (scheduler, block manager, adapter bookkeeping) is plain Python.
A step's sequences are ordered by adapter so that each adapter's rows are contiguous
(one SGMV segment), then flattened into one batch of rows.
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch
from torch import nn

from inference_server.engine.block_manager import BlockManager
from inference_server.engine.sampler import SampleResult, SampleRow, sample
from inference_server.engine.sequence import Sequence
from inference_server.engine.step_plan import plan_step, run_forward
from inference_server.lora.batch import LoraBatchBuilder
from inference_server.lora.layers import LoraContext, attach_lora
from inference_server.model.config import ModelConfig


@dataclass(frozen=True, slots=True)
class StepOutput:
    """For each scheduled sequence (in the scheduler's order): its new token, or None when
    this step only advanced a chunked prefill."""

    sampled: list[int | None]
    result: SampleResult | None
    sampled_seqs: list[Sequence]


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        config: ModelConfig,
        blocks: BlockManager,
        adapter_pool: torch.Tensor,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        lora_attach: Callable[[nn.Module, LoraContext], None] = attach_lora,
    ) -> None:
        self.model = model
        self.config = config
        self.blocks = blocks
        self.device = adapter_pool.device
        self.dtype = adapter_pool.dtype
        self.kv_caches = [
            torch.zeros(2, blocks.num_blocks, blocks.block_size, config.num_kv_heads, config.head_dim,
                        dtype=self.dtype, device=self.device)
            for _ in range(config.num_layers)
        ]
        self.lora_ctx = LoraContext()
        lora_attach(model, self.lora_ctx)  # tensor parallelism passes its own (parallel/lora.py)
        self.lora_builder = LoraBatchBuilder(config, adapter_pool, max_num_seqs, max_num_batched_tokens)

    @torch.inference_mode()
    def execute(self, seqs: Seq[Sequence], num_tokens: Seq[int]) -> StepOutput:
        plan = plan_step(seqs, num_tokens, self.blocks.block_size)
        hidden = run_forward(self.model, plan, self.kv_caches, self.lora_ctx, self.lora_builder, self.device)
        sample_seqs = [seqs[i] for i in plan.sampled]
        result = self._sample(hidden, plan.sample_rows, sample_seqs)
        by_seq = {id(s): t for s, t in zip(sample_seqs, result.token_ids if result else [])}
        return StepOutput([by_seq.get(id(s)) for s in seqs], result, sample_seqs)

    def _sample(self, hidden: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> SampleResult | None:
        if not rows:
            return None
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        return sample(logits, [SampleRow(s.request.sampling, s.token_ids, s.generator) for s in seqs])

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def close(self) -> None:
        """Release what the runner started besides tensors (tensor-parallel workers); no-op here."""
