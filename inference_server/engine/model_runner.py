"""The one object that owns the device: model, KV cache, LoRA tables; runs one step.

Everything above it (scheduler, block manager, adapter bookkeeping) is plain Python.
A step's sequences are ordered by adapter so that each adapter's rows are contiguous
(one SGMV segment), then flattened into one batch of rows. On CUDA, a step of up to 512 rows
whose prompt chunks are short enough (``step_plan.graph_span``: a fresh prompt of up to ~511
tokens) replays a CUDA graph, every row on the paged decode kernel (engine/cuda_graphs.py); the
others (long prompts, larger steps) run eagerly, where decode rows and short chunks take the
paged decode kernel and the rest SDPA.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

import torch
from torch import nn

from loraplex.inference_server.engine.block_manager import BlockManager
from loraplex.inference_server.engine.cuda_graphs import MAX_GRAPH_ROWS, GraphShape, StepGraphs
from loraplex.inference_server.engine.grammar import MaskFiller
from loraplex.inference_server.engine.launched import LaunchedLogprobs, LaunchedStep
from loraplex.inference_server.engine.sampler import (SampleResult, SampleRow, TokenMasks, apply_penalties, choose,
                                                       logprobs_on_device, sample, to_device)
from loraplex.inference_server.engine.seen_tokens import OutputCounts, SeenTokens
from loraplex.inference_server.engine.sequence import PLACEHOLDER, Sequence
from loraplex.inference_server.engine.step_peers import StepPeers
from loraplex.inference_server.engine.step_plan import plan_step, run_forward
from loraplex.inference_server.lora.batch import MAX_LORA_RANK, LoraBatchBuilder
from loraplex.inference_server.lora.layers import LoraContext, attach_lora
from loraplex.inference_server.lora.pool.pool_writes import WriteListener
from loraplex.inference_server.model.config import ModelConfig
from loraplex import kernels
from loraplex.kernels import paged_decode

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RunnerOptions:
    """What the runner sizes its static buffers by (EngineConfig's view for the runner)."""

    max_model_len: int | None = None  # None = the model's context window
    max_lora_rank: int = MAX_LORA_RANK
    cuda_graph_sizes: tuple[int, ...] = ()  # step row counts to capture (CUDA, 16-bit); () = eager
    lora_side_stream: bool = True  # in graphs, LoRA shrinks beside the base GEMMs


@dataclass(frozen=True, slots=True)
class PromptLogprobs:
    """Log-probabilities of prompt tokens ``start``, ``start + 1``, ... (each given the tokens
    before it), computed by one prefill chunk, and ``top``: their alternatives (None: none asked)."""

    start: int
    chosen: list[float]
    top: list[dict[int, float] | None]


@dataclass(frozen=True, slots=True)
class StepOutput:
    """For each scheduled sequence (in the scheduler's order): its new token, or None when
    this step only advanced a chunked prefill; ``prompt_logprobs``: id(seq) -> what this step's
    chunk computed of its prompt's log-probabilities, for the sequences that asked."""

    sampled: list[int | None]
    result: SampleResult | None
    sampled_seqs: list[Sequence]
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)


_PROMPT_LOGPROB_ROWS = 256  # rows of a prompt chunk whose logits are made at once (V floats each)


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
        options: RunnerOptions = RunnerOptions(),
        peers: StepPeers | None = None,
    ) -> None:
        self.model = model
        self.peers = peers
        self.prompt_logprobs = peers is None  # can compute a prompt's own log-probabilities (eager steps)
        self.config = config
        self.blocks = blocks
        self.device = adapter_pool.device
        self.dtype = adapter_pool.dtype
        max_len = options.max_model_len or config.max_position_embeddings
        rows = max([max_num_seqs, *options.cuda_graph_sizes, min(MAX_GRAPH_ROWS, max_num_batched_tokens)])
        # with peers, every rank runs the same portable attention (the workers have no workspace)
        self.decode_workspace = (None if peers is not None
                                 else _decode_workspace(config, self.dtype, self.device, rows, max_len))
        use_graphs = peers is None and bool(options.cuda_graph_sizes) and self.decode_workspace is not None and self.dtype in _GRAPH_DTYPES
        # with graphs, one block past the block manager's: the slot padding rows write to
        self.kv_caches = [
            torch.zeros(2, blocks.num_blocks + use_graphs, blocks.block_size, config.num_kv_heads, config.head_dim,
                        dtype=self.dtype, device=self.device)
            for _ in range(config.num_layers)
        ]
        self.seen_tokens = SeenTokens(max_num_seqs)  # repetition-penalized rows' seen tokens, on the device
        self.output_counts = OutputCounts(max_num_seqs)  # presence/frequency-penalized rows' output counts
        self._mask_filler: MaskFiller | None = None  # made on the first constrained row (structured output)
        self.lora_ctx = LoraContext()
        lora_attach(model, self.lora_ctx)  # tensor parallelism passes its own (parallel/lora.py)
        kernels.prepare(adapter_pool)  # compiled now: a step that met them first would stall every stream
        self.lora_builder = LoraBatchBuilder(config, adapter_pool, max_num_seqs, max_num_batched_tokens,
                                             options.max_lora_rank)
        self.graphs = None
        self.why_eager = peers.why_eager if peers is not None else _why_eager(
            options, self.device, self.dtype, self.decode_workspace, config)
        if use_graphs:
            shape = GraphShape(tuple(sorted(s for s in options.cuda_graph_sizes if s <= max_num_batched_tokens)),
                               -(-max_len // blocks.block_size), blocks.block_size, blocks.num_blocks * blocks.block_size)
            self.graphs = StepGraphs(model, self.kv_caches, self.lora_ctx, self.lora_builder,
                                       self.decode_workspace, shape, self.device, options.lora_side_stream)
            self.graphs.capture()
            # sampled tokens of launched steps: two pinned buffers, used in turn (one step's
            # tokens are read before the step after next is launched)
            self._token_host = [torch.zeros(rows, dtype=torch.int64).pin_memory() for _ in range(2)]
            self._token_turn = 0

    def pool_write_listener(self) -> WriteListener | None:
        """Where the adapter pool reports its writes for this runner's LoRA step cache (None: it
        keeps no copy of the pool)."""
        return self.lora_builder.pool_write_listener()

    @property
    def can_launch(self) -> bool:
        """Whether ``launch`` can ever run a step (CUDA graphs are captured)."""
        return self.graphs is not None

    @torch.inference_mode()
    def launch(self, seqs: Seq[Sequence], num_tokens: Seq[int], feed: LaunchedStep | None) -> LaunchedStep | None:
        """Start a step on the device without waiting for it, or return None (nothing done)
        when it cannot run that way: it needs an eager forward, or an input token is a
        placeholder that ``feed`` (the step still running) does not sample. Placeholder inputs
        are copied on the device from ``feed.tokens``; sampling, penalties and log-probabilities
        run on the device as ``sample`` does them, nothing read back."""
        if self.graphs is None or _wants_prompt_logprobs(seqs):
            return None
        plan = plan_step(seqs, num_tokens, self.blocks.block_size)
        size = self.graphs.size_for(plan)
        fed = _fed_rows(plan, seqs, feed) if size is not None else None
        if fed is None:
            return None
        sample_seqs = [seqs[i] for i in plan.sampled]
        logits = self.graphs.replay(plan, size, fed).float()
        rows = self._sample_rows(sample_seqs)
        history = self._history(sample_seqs, logits, feed)
        tokens = choose(apply_penalties(logits, rows, *history, self._masks(sample_seqs, logits)), rows)
        host = self._token_host[self._token_turn][: len(sample_seqs)]
        self._token_turn ^= 1
        host.copy_(tokens, non_blocking=True)
        logprobs = _to_pinned(rows, logprobs_on_device(logits, tokens, rows))
        ready = torch.cuda.Event()
        ready.record()
        return LaunchedStep(list(seqs), list(num_tokens), sample_seqs, tokens, host, ready, logprobs=logprobs)

    @torch.inference_mode()
    def execute(self, seqs: Seq[Sequence], num_tokens: Seq[int]) -> StepOutput:
        plan = plan_step(seqs, num_tokens, self.blocks.block_size)
        if self.peers is not None:
            self.peers.send(plan)
        sample_seqs = [seqs[i] for i in plan.sampled]
        eager = self.graphs is None or _wants_prompt_logprobs(seqs)  # prompt log-probabilities need every row
        size = None if eager else self.graphs.size_for(plan)
        if size is not None:
            logits = self.graphs.replay(plan, size)
            result = sample(logits, self._sample_rows(sample_seqs), *self._history(sample_seqs, logits),
                            self._masks(sample_seqs, logits))
            by_seq = {id(s): t for s, t in zip(sample_seqs, result.token_ids)}
            return StepOutput([by_seq.get(id(s)) for s in seqs], result, sample_seqs)
        hidden = run_forward(self.model, plan, self.kv_caches, self.lora_ctx, self.lora_builder, self.device,
                             self.decode_workspace)
        return self.outputs(plan, hidden, seqs)

    def outputs(self, plan, hidden: torch.Tensor, seqs: Seq[Sequence]) -> StepOutput:
        """The StepOutput of an eager step: its sampled rows' tokens, and the prompt
        log-probabilities its chunks computed for the sequences that asked."""
        sample_seqs = [seqs[i] for i in plan.sampled]
        result = self._sample(hidden, plan.sample_rows, sample_seqs)
        by_seq = {id(s): t for s, t in zip(sample_seqs, result.token_ids if result else [])}
        prompt = self._prompt_logprobs(hidden, plan, seqs) if _wants_prompt_logprobs(seqs) else {}
        return StepOutput([by_seq.get(id(s)) for s in seqs], result, sample_seqs, prompt)

    def _sample(self, hidden: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> SampleResult | None:
        if not rows:
            return None
        logits = self.model.compute_logits(hidden[torch.tensor(rows, device=self.device)])
        return sample(logits, self._sample_rows(seqs), *self._history(seqs, logits), self._masks(seqs, logits))

    def _prompt_logprobs(self, hidden: torch.Tensor, plan, seqs: Seq[Sequence]) -> dict[int, PromptLogprobs]:
        """Per sequence that asked, the log-probabilities of the prompt tokens its chunk's rows
        predict (row at position p predicts prompt token p + 1), with its top alternatives."""
        out = {}
        for span, i in zip(plan.spans, plan.span_seqs):
            seq, k = seqs[i], seqs[i].request.sampling.prompt_logprobs
            first = span.ctx_len - span.q_len
            last = min(span.ctx_len, seq.num_prompt - 1)
            if k is None or last <= first:
                continue
            chosen: list[float] = []
            top: list[dict[int, float] | None] = []
            for lo in range(first, last, _PROMPT_LOGPROB_ROWS):
                hi = min(last, lo + _PROMPT_LOGPROB_ROWS)
                rows = torch.arange(span.q_start + lo - first, span.q_start + hi - first, device=self.device)
                logp = torch.log_softmax(self.model.compute_logits(hidden[rows]).float(), dim=-1)
                targets = torch.tensor(seq.token_ids[lo + 1 : hi + 1], device=self.device)
                chosen += logp.gather(1, targets[:, None])[:, 0].tolist()
                if k:
                    values, ids = logp.topk(k, dim=-1)
                    top += [dict(zip(r_ids, r_values)) for r_ids, r_values in zip(ids.tolist(), values.tolist())]
                else:
                    top += [None] * (hi - lo)
            out[id(seq)] = PromptLogprobs(first + 1, chosen, top)
        return out

    def _sample_rows(self, seqs: list[Sequence]) -> list[SampleRow]:
        return [SampleRow(s.request.sampling, s.token_ids, s.generator,
                          s.stop_ids if s.num_output < s.request.stopping.min_tokens else (), s.num_prompt)
                for s in seqs]

    def _history(self, seqs: list[Sequence], logits: torch.Tensor, feed: LaunchedStep | None = None):
        """(the repetition-penalized rows' seen-token mask, the presence/frequency-penalized
        rows' output counts), each None when no row needs it (``SeenTokens`` / ``OutputCounts``):
        each step adds only its new tokens, so the host's work is O(rows), not O(the
        sequences' lengths)."""
        vocab, device = logits.shape[-1], logits.device
        newest = _newest_on_device(seqs, feed)
        return (self.seen_tokens.mask(seqs, vocab, device, newest),
                self.output_counts.mask(seqs, vocab, device, newest))

    def _masks(self, seqs: list[Sequence], logits: torch.Tensor) -> TokenMasks | None:
        """The grammar masks of the constrained rows (structured output), filled on the host from
        each one's grammar state, which has taken every token of the sequence (the engine never
        launches a constrained row ahead of reading its input token); None when no row is."""
        if all(s.grammar is None for s in seqs):
            return None
        if any(s.grammar is not None and s.token_ids[-1] == PLACEHOLDER for s in seqs):
            raise RuntimeError("a constrained row's input token is not known yet; its mask cannot be filled")
        if self._mask_filler is None:  # on a GPU host the cores are free for it; on the CPU the model has them
            cores = os.cpu_count() or 1
            self._mask_filler = MaskFiller(threads=min(8, max(1, cores // 2)) if self.device.type == "cuda" else 1)
        return self._mask_filler.masks([s.grammar for s in seqs], logits.shape[-1], logits.device)

    def make_generator(self, seed: int) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(seed)

    def close(self) -> None:
        """Release what the runner started besides tensors (its peers: tensor-parallel workers)."""
        if self.peers is not None:
            self.peers.close()


def _fed_rows(plan, seqs: Seq[Sequence], feed: LaunchedStep | None):
    """(rows, indices into feed.tokens, feed.tokens) for the plan's placeholder inputs; no
    placeholders: None as the third item; None when some placeholder has no source."""
    rows = [r for r, t in enumerate(plan.token_ids) if t == PLACEHOLDER]
    if not rows:
        return [], [], None
    if feed is None:
        return None
    seq_of_row = dict(zip(plan.sample_rows, plan.sampled))  # a placeholder is a sequence's last input
    index = feed.index_of()
    src = [index.get(id(seqs[seq_of_row[r]]), -1) if r in seq_of_row else -1 for r in rows]
    return None if min(src) < 0 else (rows, src, feed.tokens)


def _to_pinned(rows: list[SampleRow], wanted) -> LaunchedLogprobs | None:
    """``logprobs_on_device``'s figures copied to pinned host memory (non-blocking)."""
    if wanted is None:
        return None
    copies = []
    for t in wanted:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        copies.append(host.copy_(t, non_blocking=True))
    return LaunchedLogprobs(rows, *copies)


def _wants_prompt_logprobs(seqs: Seq[Sequence]) -> bool:
    """Whether a sequence of the step computes prompt rows whose log-probabilities it asked for."""
    return any(s.request.sampling.prompt_logprobs is not None and s.num_computed < s.num_prompt - 1 for s in seqs)


def _penalized(seq: Sequence) -> bool:
    sampling = seq.request.sampling
    return sampling.repetition_penalty != 1.0 or sampling.counts_output


def _newest_on_device(seqs: list[Sequence], feed: LaunchedStep | None):
    """(rows, token ids on the device) of the penalized rows whose newest token is a
    placeholder: it is in ``feed.tokens`` (``_fed_rows`` found every placeholder there)."""
    penalized = [i for i, s in enumerate(seqs) if _penalized(s) and s.token_ids and s.token_ids[-1] == PLACEHOLDER]
    if not penalized or feed is None:
        return None
    index = feed.index_of()
    return penalized, feed.tokens[to_device([index[id(seqs[i])] for i in penalized], feed.tokens.device)]


_GRAPH_DTYPES = (torch.bfloat16, torch.float16)  # float32 CUDA LoRA is the (host-syncing) reference


def _why_eager(options: RunnerOptions, device: torch.device, dtype: torch.dtype, workspace,
               config: ModelConfig) -> str | None:
    """Why this runner runs every step eager (no CUDA graphs, so no launch-ahead); None if it does not."""
    if device.type != "cuda":
        return f"CUDA graphs need a GPU (the engine runs on {device})"
    if dtype not in _GRAPH_DTYPES:
        return f"CUDA graphs are captured in bfloat16 or float16 (the engine runs {str(dtype).removeprefix('torch.')})"
    if not options.cuda_graph_sizes:
        return "CUDA graphs are off (--cuda-graphs off)"
    if workspace is None:
        return (f"the paged decode kernel does not handle {config.num_heads}/{config.num_kv_heads} heads of "
                f"dim {config.head_dim}")
    return None


def _decode_workspace(config: ModelConfig, dtype: torch.dtype, device: torch.device, max_seqs: int, max_len: int):
    """Split partials of the paged decode kernel, or None where it does not apply (CPU, or an
    attention shape it does not handle: those steps take the portable path)."""
    workspace = paged_decode.decode_workspace(dtype, config.head_dim, config.num_heads, config.num_kv_heads,
                                                 max_seqs, max_len, device)
    if workspace is None and device.type == "cuda":
        log.warning("paged decode kernel does not handle %d/%d heads of dim %d in %s: portable attention",
                    config.num_heads, config.num_kv_heads, config.head_dim, dtype)
    return workspace
