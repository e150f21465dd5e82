"""One step's batch as plain data, and the forward that runs it.

Sequences are ordered by adapter id (each adapter's rows contiguous: one SGMV segment),
each sequence's new tokens contiguous. ``ModelRunner`` runs plans on one device; with
tensor parallelism rank 0 broadcasts the same plan and every rank runs it.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from inference_server.engine.sequence import Sequence
from inference_server.lora.batch import LoraBatchBuilder
from inference_server.lora.layers import LoraContext
from inference_server.lora.packing import AdapterLayout
from inference_server.model.attention import AttentionMetadata, SequenceSpan
from inference_server.model.llama import ForwardBatch


@dataclass(frozen=True, slots=True)
class AdapterTables:
    """What the LoRA table builder reads of a resident adapter (offsets valid on every rank)."""

    a_offsets: tuple[int, ...]
    b_offsets: tuple[int, ...]
    layout: AdapterLayout


@dataclass(frozen=True, slots=True)
class SpanPlan:
    q_start: int
    q_len: int
    ctx_len: int
    block_table: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class StepPlan:
    """Token ids, positions, block tables and LoRA rows of one step, in batch order."""

    token_ids: list[int]
    positions: list[int]
    spans: list[SpanPlan]
    block_size: int
    lora_rows: list[tuple[int, AdapterTables | None]]  # (rows, adapter) per sequence
    sample_rows: list[int]  # rows whose next token is sampled this step
    sampled: list[int]  # the sequences (indices in the scheduler's list) those rows belong to


def plan_step(seqs: Seq[Sequence], num_tokens: Seq[int], block_size: int) -> StepPlan:
    """Lay out a step (rank 0, plain Python). Sequences sharing an adapter object share one
    ``AdapterTables`` object, so they still form one LoRA segment after pickling."""
    order = sorted(range(len(seqs)), key=lambda i: seqs[i].adapter_key)
    ids, positions, spans, lora_rows, sample_rows, sampled = [], [], [], [], [], []
    tables: dict[int, AdapterTables] = {}
    row = 0
    for i in order:
        seq, n = seqs[i], num_tokens[i]
        start = seq.num_computed
        ids += seq.token_ids[start : start + n]
        positions += range(start, start + n)
        spans.append(SpanPlan(row, n, start + n, tuple(seq.block_table)))
        ra = seq.adapter
        if ra is not None and id(ra) not in tables:
            tables[id(ra)] = AdapterTables(tuple(ra.a_offsets), tuple(ra.b_offsets), ra.layout)
        lora_rows.append((n, None if ra is None else tables[id(ra)]))
        row += n
        if start + n == len(seq.token_ids):
            sample_rows.append(row - 1)
            sampled.append(i)
    return StepPlan(ids, positions, spans, block_size, lora_rows, sample_rows, sampled)


def _slots(table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    return table[positions // block_size] * block_size + positions % block_size


def forward_batch(plan: StepPlan, kv_caches: list[torch.Tensor], device: torch.device) -> ForwardBatch:
    """The attention metadata of ``plan`` (slots computed from block tables on each rank)."""
    slot_parts, spans = [], []
    for span in plan.spans:
        table = torch.tensor(span.block_table, dtype=torch.int64)
        ctx = _slots(table, torch.arange(span.ctx_len), plan.block_size)
        slot_parts.append(ctx[span.ctx_len - span.q_len :])
        spans.append(SequenceSpan(span.q_start, span.q_len, span.ctx_len, ctx.to(device)))
    slots = torch.cat(slot_parts) if slot_parts else torch.empty(0, dtype=torch.int64)
    return ForwardBatch(
        positions=torch.tensor(plan.positions, dtype=torch.int64, device=device),
        kv_caches=kv_caches,
        attn=AttentionMetadata(slots.to(device), spans),
    )


def run_forward(
    model: torch.nn.Module, plan: StepPlan, kv_caches: list[torch.Tensor], lora_ctx: LoraContext,
    lora_builder: LoraBatchBuilder, device: torch.device,
) -> torch.Tensor:
    """Hidden states [T, H] of the plan's rows (every rank calls it with the same plan)."""
    batch = forward_batch(plan, kv_caches, device)
    lora_ctx.batch = lora_builder.build(plan.lora_rows)
    try:
        return model(torch.tensor(plan.token_ids, dtype=torch.int64, device=device), batch)
    finally:
        lora_ctx.batch = None
