"""One step's batch as plain data, and the forward that runs it.

Sequences are ordered by adapter id (each adapter's rows contiguous: one SGMV segment),
each sequence's new tokens contiguous. ``ModelRunner`` runs plans on one device; with
tensor parallelism rank 0 broadcasts the same plan and every rank runs it.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import torch

from loraplex.inference_server.engine.sequence import Sequence
from loraplex.inference_server.lora.batch import LoraBatchBuilder
from loraplex.inference_server.lora.layers import LoraContext
from loraplex.inference_server.lora.resident import AdapterPlacement
from loraplex.inference_server.model.attention import AttentionMetadata, DecodeRows, SequenceSpan
from loraplex.inference_server.model.llama import ForwardBatch
from loraplex.kernels import paged_decode


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
    lora_rows: list[tuple[int, AdapterPlacement | None]]  # (rows, adapter's placement) per sequence
    sample_rows: list[int]  # rows whose next token is sampled this step
    sampled: list[int]  # the sequences (indices in the scheduler's list) those rows belong to
    span_seqs: list[int]  # per span, its sequence (index in the scheduler's list)


def plan_step(seqs: Seq[Sequence], num_tokens: Seq[int], block_size: int) -> StepPlan:
    """Lay out a step (rank 0, plain Python). Sequences of one resident adapter carry its one
    ``AdapterPlacement`` object, so they form one LoRA segment (pickling keeps them one)."""
    order = sorted(range(len(seqs)), key=lambda i: seqs[i].adapter_key)
    ids, positions, spans, lora_rows, sample_rows, sampled = [], [], [], [], [], []
    row = 0
    for i in order:
        seq, n = seqs[i], num_tokens[i]
        start = seq.num_computed
        ids += seq.token_ids[start : start + n]
        positions += range(start, start + n)
        spans.append(SpanPlan(row, n, start + n, tuple(seq.block_table)))
        lora_rows.append((n, None if seq.adapter is None else seq.adapter.placement))
        row += n
        if start + n == len(seq.token_ids):
            sample_rows.append(row - 1)
            sampled.append(i)
    return StepPlan(ids, positions, spans, block_size, lora_rows, sample_rows, sampled, order)


def _slots(table: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    return table[positions // block_size] * block_size + positions % block_size


def _new_slots(span: SpanPlan, block_size: int) -> list[int]:
    """Cache slots of the span's new tokens (positions ctx_len - q_len .. ctx_len - 1)."""
    table = span.block_table
    return [table[t // block_size] * block_size + t % block_size for t in range(span.ctx_len - span.q_len, span.ctx_len)]


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


# In an eager step, a span's rows go to the paged decode kernel, each as one query over its own
# causal prefix, when it is a decode or a prefill chunk whose rows together read at most this
# many cached tokens (re-reading the prefix per row then costs less than a separate attention
# call). Punica's prompts (median 17 tokens) all qualify.
SHORT_PREFILL_READS = 16384
# A step replays a CUDA graph (every span on the paged decode kernel) when each of its prefill
# chunks makes its rows read at most this many cached tokens in all (row i of a chunk reads the
# ctx_len - q_len + i + 1 tokens up to it): a fresh prompt of up to 511 tokens. The rows re-read
# their prefix, but an eager step costs far more in launches (H200, 7B bf16, 32 decodes + one
# fresh prompt, eager -> graph step, ms: 224 tokens 21.2 -> 11.6, 480 tokens 28.8 -> 25.4; with
# 33 distinct adapters 59.7 -> 15.9 and 71.5 -> 36.8: benchmarks/history/RESULTS-2026.md).
GRAPH_PREFILL_READS = 1 << 17


def kernel_span(span: SpanPlan) -> bool:
    """Whether an eager step runs the span on the paged decode kernel."""
    return span.q_len == 1 or span.q_len * span.ctx_len <= SHORT_PREFILL_READS


def causal_reads(span: SpanPlan) -> int:
    """Cached tokens the span's rows read in all, each row over its own causal prefix."""
    before = span.ctx_len - span.q_len
    return span.q_len * before + span.q_len * (span.q_len + 1) // 2


def graph_span(span: SpanPlan) -> bool:
    """Whether a step replayed from a CUDA graph may hold the span (on the paged decode kernel)."""
    return span.q_len == 1 or causal_reads(span) <= GRAPH_PREFILL_READS


def kernel_rows(span: SpanPlan) -> tuple[range, range]:
    """(rows, context lengths) of a kernel span: row q_start + i sees ctx_len - q_len + i + 1 tokens."""
    first = span.ctx_len - span.q_len + 1
    return range(span.q_start, span.q_start + span.q_len), range(first, first + span.q_len)


def _decode_rows(spans: list[SpanPlan], device: torch.device, workspace) -> DecodeRows:
    width = max(len(s.block_table) for s in spans)
    rows, lens, tables = [], [], []
    for s in spans:
        r, n = kernel_rows(s)
        rows += r
        lens += n
        tables += [list(s.block_table) + [0] * (width - len(s.block_table))] * s.q_len
    return DecodeRows(
        rows=_to_device(rows, torch.int32, device),
        block_tables=_to_device(tables, torch.int32, device),
        context_lens=_to_device(lens, torch.int32, device),
        num_splits=paged_decode.decode_splits(max(s.ctx_len for s in spans)),
        workspace=workspace,
    )


def forward_batch(
    plan: StepPlan, kv_caches: list[torch.Tensor], device: torch.device, decode_workspace=None
) -> ForwardBatch:
    """The attention metadata of ``plan`` (slots computed from block tables on each rank).

    With a ``decode_workspace`` (``loraplex.kernels.paged_decode.decode_workspace``'s), the rows
    of decodes and short prefill chunks (``kernel_span``) go to the paged decode kernel, up
    to the workspace's row capacity; the other spans take the portable path.
    """
    slot_mapping: list[int] = []
    spans, decodes = [], []
    room = decode_workspace.max_seqs if decode_workspace is not None else 0
    for span in plan.spans:
        slot_mapping += _new_slots(span, plan.block_size)
        if kernel_span(span) and span.q_len <= room:
            decodes.append(span)
            room -= span.q_len
            continue
        table = torch.tensor(span.block_table, dtype=torch.int64)
        ctx = _slots(table, torch.arange(span.ctx_len), plan.block_size)
        spans.append(SequenceSpan(span.q_start, span.q_len, span.ctx_len, ctx.to(device)))
    return ForwardBatch(
        positions=_to_device(plan.positions, torch.int64, device),
        kv_caches=kv_caches,
        attn=AttentionMetadata(
            _to_device(slot_mapping, torch.int64, device), spans,
            _decode_rows(decodes, device, decode_workspace) if decodes else None,
        ),
    )


def run_forward(
    model: torch.nn.Module, plan: StepPlan, kv_caches: list[torch.Tensor], lora_ctx: LoraContext,
    lora_builder: LoraBatchBuilder, device: torch.device, decode_workspace=None,
) -> torch.Tensor:
    """Hidden states [T, H] of the plan's rows (every rank calls it with the same plan)."""
    batch = forward_batch(plan, kv_caches, device, decode_workspace)
    lora_ctx.batch = lora_builder.build(plan.lora_rows)
    try:
        return model(torch.tensor(plan.token_ids, dtype=torch.int64, device=device), batch)
    finally:
        lora_ctx.batch = None
