"""Steps replayed from CUDA graphs captured at start-up.

A step whose every row the paged decode kernel can serve (decodes, and prefill chunks short
enough for ``step_plan.graph_span``: each row one query over its own causal prefix) of T
rows replays the graph captured for the smallest captured row count >= T, so admitting a
request with a prompt of up to ~511 tokens does not make the whole step eager. Rows past T
(all of them, up to the largest size) are padding: token 0 at position 0, its key/value
written to a scratch slot outside the block manager's blocks, context length 0 (the decode
kernel gives zeros) and no LoRA segment. Everything a step changes lives in static buffers
written before the replay: token ids, positions, new-token slots, per-row block tables and
context lengths (staged in pinned memory, two copies per step), and the LoRA tables
(``LoraBatchBuilder``'s buffers, static already). Two graphs per size: with LoRA (every
projection group; rank-0 slots skip) and without. In the LoRA graphs each shrink is a branch
beside its base GEMM (both read only x); the expand joins.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from loraplex.inference_server.engine.step_plan import SpanPlan, StepPlan, graph_span
from loraplex.inference_server.lora.batch import LoraBatchBuilder
from loraplex.inference_server.lora.layers import LoraContext
from loraplex.inference_server.model.attention import AttentionMetadata, DecodeRows
from loraplex.inference_server.model.llama import ForwardBatch

log = logging.getLogger(__name__)


MAX_GRAPH_ROWS = 512  # larger steps (long prefill chunks) run eagerly


def default_sizes(max_num_seqs: int, max_num_batched_tokens: int) -> tuple[int, ...]:
    """Row counts to capture: 1, 2, 4, 8, then steps of 8 to 32, of 16 to 128 and of 32 beyond,
    up to max_num_seqs (decode batches; a step pads to the next size, and a decode step costs its
    weights' bytes whatever its rows, so coarser sizes at large batches cost little and keep start-up
    and graph memory small at 256), then a few larger ones for steps that also admit short prompts."""
    ladder = [1, 2, 4, *range(8, 32, 8), *range(32, 128, 16), *range(128, MAX_GRAPH_ROWS + 1, 32)]
    sizes = [s for s in ladder if s < max_num_seqs] + [max_num_seqs]
    sizes += [s for s in (48, 64, 96, 128, 192, 256, 384, 512) if s > max_num_seqs]
    cap = min(MAX_GRAPH_ROWS, max_num_batched_tokens)
    return tuple(sorted({min(s, cap) for s in sizes}))


@dataclass(frozen=True, slots=True)
class GraphShape:
    sizes: tuple[int, ...]  # row counts to capture
    max_blocks: int  # block-table width (max context / block size, rounded up)
    block_size: int
    pad_slot: int  # cache slot the padding rows write to


def graph_size(shape: GraphShape, rows: int, spans: Sequence[SpanPlan], samples: bool) -> int | None:
    """The captured size that runs a step of ``rows`` rows over ``spans``, or None when it must run
    eagerly: no rows or nothing sampled, more rows than the largest graph, a block table wider than
    the graphs' or a prompt chunk past ``graph_span``. (A function of shapes alone: the scheduler's
    replay, benchmarks/engine/replay_scheduler.py, asks it without a GPU.)"""
    if rows == 0 or not samples or rows > shape.sizes[-1]:
        return None
    if any(len(s.block_table) > shape.max_blocks or not graph_span(s) for s in spans):
        return None
    return next(s for s in shape.sizes if s >= rows)


class StepGraphs:
    def __init__(
        self, model: nn.Module, kv_caches: list[torch.Tensor], lora_ctx: LoraContext, lora_builder: LoraBatchBuilder,
        workspace, shape: GraphShape, device: torch.device, lora_side_stream: bool = True,
    ) -> None:
        self.model, self.kv_caches, self.lora_ctx, self.lora_builder = model, kv_caches, lora_ctx, lora_builder
        # the LoRA shrinks run on this stream beside the base GEMMs (graph branches)
        self.lora_stream = torch.cuda.Stream(device) if lora_side_stream else None
        self.workspace, self.shape, self.device = workspace, shape, device
        cap, width = max(shape.sizes), shape.max_blocks
        # staging (pinned) and static (device) buffers, one copy each per step:
        # int64 rows: token ids, positions, new-token slots, then the rows whose token ids come
        # from a running step's sampled tokens and their indices there;
        # int32: context lengths, then block tables
        self.host_i64 = torch.zeros(5, cap, dtype=torch.int64).pin_memory()
        self.host_i32 = torch.zeros(cap * (1 + width), dtype=torch.int32).pin_memory()
        self.dev_i64 = torch.zeros(5, cap, dtype=torch.int64, device=device)
        self.dev_i32 = torch.zeros(cap * (1 + width), dtype=torch.int32, device=device)
        self.ids, self.positions, self.slots, self.fed_rows, self.fed_src = self.dev_i64.unbind(0)
        self.staged = torch.cuda.Event()  # after the last staging copies: the host buffers are free again
        self.lens, self.tables = self.dev_i32[:cap], self.dev_i32[cap:].view(cap, width)
        self.rows = torch.arange(cap, dtype=torch.int32, device=device)
        self._np_i64 = self.host_i64.numpy()
        self._np_lens = self.host_i32[:cap].numpy()
        self._np_tables = self.host_i32[cap:].view(cap, width).numpy()
        self.graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.replays = 0  # decode steps served from a graph (tests and benchmarks read it)

    # -- capture ----------------------------------------------------------------------
    @torch.inference_mode()
    def capture(self) -> None:
        start = time.perf_counter()
        self.slots.fill_(self.shape.pad_slot)  # capture-time rows: padding (context 0)
        pool = None
        for size in sorted(self.shape.sizes, reverse=True):  # largest first: the pool only shrinks
            for lora in (True, False):
                graph, logits = self._capture_one(size, lora, pool)
                pool = graph.pool()
                self.graphs[(size, lora)] = (graph, logits)
        torch.cuda.synchronize(self.device)
        log.info("captured %d step CUDA graphs (row counts %s) in %.1f s", len(self.graphs),
                 ",".join(map(str, self.shape.sizes)), time.perf_counter() - start)

    def _forward_batch(self, size: int) -> ForwardBatch:
        decode = DecodeRows(self.rows[:size], self.tables[:size], self.lens[:size], self.workspace.max_splits,
                            self.workspace)
        return ForwardBatch(self.positions[:size], self.kv_caches, AttentionMetadata(self.slots[:size], [], decode))

    def _capture_one(self, size: int, lora: bool, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        batch = self._forward_batch(size)
        self.lora_ctx.batch = self.lora_builder.static_batch(self.lora_stream) if lora else None
        try:
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):  # warm-up: compiles kernels, grows scratch
                self.model.compute_logits(self.model(self.ids[:size], batch))
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.model.compute_logits(self.model(self.ids[:size], batch))
            return graph, logits
        finally:
            self.lora_ctx.batch = None

    # -- replay -----------------------------------------------------------------------
    def size_for(self, plan: StepPlan) -> int | None:
        """The captured size that runs ``plan``, or None when the step must run eagerly."""
        return graph_size(self.shape, len(plan.token_ids), plan.spans, bool(plan.sample_rows))

    def replay(self, plan: StepPlan, size: int, fed=None) -> torch.Tensor:
        """Logits [len(sample_rows), V] of the plan's sampled rows; writes the LoRA tables first.
        fed: (rows, src, tokens): the token id of each row in rows is tokens[src] (a device
        tensor a step still running writes); those rows' ids in the plan are placeholders."""
        lora = self.lora_builder.build(plan.lora_rows) is not None
        self._stage(plan, fed)
        graph, logits = self.graphs[(size, lora)]
        graph.replay()
        self.replays += 1
        rows = plan.sample_rows
        if len(rows) == len(plan.token_ids):  # every row samples (a decode step)
            return logits[: len(rows)]
        return logits[torch.tensor(rows, device=logits.device)]

    def _stage(self, plan: StepPlan, fed) -> None:
        n, bs = len(plan.token_ids), self.shape.block_size
        ids, tables, lens = self._np_i64, self._np_tables, self._np_lens
        self.staged.synchronize()  # the previous step's copies have read the host buffers
        ids[0, :n] = plan.token_ids
        fed_rows, fed_src, tokens = fed if fed is not None else ([], [], None)
        ids[0, fed_rows] = 0  # placeholders: overwritten on the device below
        ids[3, : len(fed_rows)] = fed_rows
        ids[4, : len(fed_src)] = fed_src
        if (ids[0, :n] < 0).any():
            raise RuntimeError("a step's token ids hold placeholders that no running step samples")
        ids[1, :n] = plan.positions
        ids[2, :n] = [s.block_table[p // bs] * bs + p % bs
                      for s in plan.spans for p in range(s.ctx_len - s.q_len, s.ctx_len)]
        # every row past n is padding, not only those of this size: no replay, of any size, sees an
        # older step's rows (their new-token slots may name one cache slot twice, once a finished
        # sequence's block went to another, and two rows writing one slot race)
        ids[:2, n:] = 0
        ids[2, n:] = self.shape.pad_slot
        lens[:n] = ids[1, :n] + 1  # each row sees its own causal prefix
        lens[n:] = 0
        for s in plan.spans:
            tables[s.q_start : s.q_start + s.q_len, : len(s.block_table)] = s.block_table
        self.dev_i64.copy_(self.host_i64, non_blocking=True)
        self.dev_i32.copy_(self.host_i32, non_blocking=True)
        self.staged.record()
        if fed_rows:
            k = len(fed_rows)
            self.ids.index_copy_(0, self.fed_rows[:k], tokens.index_select(0, self.fed_src[:k]))
