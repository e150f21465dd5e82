"""The profile run: measure, once at start and before the KV cache and adapter pool are sized,
what a running engine needs beyond them (engine/memory_plan.Reserve), as vLLM's profile run does.

A throwaway eager runner over the loaded model (a KV cache just large enough, no adapter pool,
no CUDA graphs) runs the two largest steps the engine can schedule: a prefill chunk of
``max_num_batched_tokens`` tokens that asks for its prompt's log-probabilities (their logits are
the largest eager tensors), and a decode of ``max_num_seqs`` rows with every penalty, top
log-probabilities and sampling on (their device tables). The allocator's peak above what was
held before each step is the activations' share. CUDA graphs are not captured twice: their pool
is estimated from the measured decode peak at the largest captured row count and the logits each
graph keeps, and ``check_after_start`` verifies on the real engine that the memory left still
holds the measured eager peak.
"""

from __future__ import annotations

import gc
import logging

import torch
from torch import nn

from loraplex.inference_server.engine.block_manager import BlockManager
from loraplex.inference_server.engine.config import EngineConfig
from loraplex.inference_server.engine.memory_plan import Reserve, gib
from loraplex.inference_server.engine.model_runner import ModelRunner, RunnerOptions
from loraplex.inference_server.engine.request import (MAX_TOP_LOGPROBS, GenerationRequest, SamplingParams,
                                                       StoppingCriteria)
from loraplex.inference_server.engine.sequence import Sequence
from loraplex.inference_server.model.config import ModelConfig

log = logging.getLogger(__name__)

MiB = 1 << 20
SLACK_SHARE = 0.02  # of the device's memory: cuBLAS workspaces, allocator rounding, kernels loaded later
SLACK_MIN = 512 * MiB


def _no_lora(model: nn.Module, ctx) -> None:
    """The profile runner leaves the model's projections as they are: the real runner wraps them
    (the LoRA deltas add into the projection's output in place; their tables are runner buffers)."""


def measure_reserve(module: nn.Module, model_config: ModelConfig, config: EngineConfig, max_len: int,
                    graph_sizes: tuple[int, ...]) -> Reserve:
    device = torch.device(config.device)
    tokens, rows = config.max_num_batched_tokens, config.max_num_seqs
    prefill_len = min(tokens, max_len)
    prompts = max(1, tokens // prefill_len)
    # enough blocks for the prompts (each may end in a part-filled block) and a block a decoding row
    blocks = BlockManager(-(-tokens // config.block_size) + prompts + rows + 1, config.block_size,
                          prefix_caching=False)
    _settle(device)
    before = torch.cuda.memory_allocated(device)
    pool = torch.zeros(1, dtype=config.torch_dtype, device=device)
    runner = ModelRunner(module, model_config, blocks, pool, rows, tokens, lora_attach=_no_lora,
                         options=RunnerOptions(max_model_len=max_len, max_lora_rank=config.max_lora_rank))
    try:
        caches = sum(t.numel() * t.element_size() for t in runner.kv_caches) + pool.numel() * pool.element_size()
        buffers = torch.cuda.memory_allocated(device) - before - caches
        vocab = model_config.vocab_size
        prefill = [_prompt(f"p{i}", prefill_len, vocab, blocks, prompt_logprobs=MAX_TOP_LOGPROBS)
                   for i in range(prompts)]
        prefill_peak = _step_peak(runner, prefill, [s.num_pending for s in prefill], device)
        for s in prefill:
            blocks.free(s.block_table)
        decode = [_decoding(f"d{i}", vocab, blocks) for i in range(rows)]
        decode_peak = _step_peak(runner, decode, [1] * rows, device)
    finally:
        del runner, pool
        _settle(device)
    largest = max(graph_sizes, default=0)
    per_row = max(decode_peak / rows, prefill_peak / tokens)
    graphs = 0 if not graph_sizes else int(per_row * largest) + 2 * sum(graph_sizes) * vocab * _elem(config)
    total = torch.cuda.get_device_properties(device).total_memory
    reserve = Reserve(buffers, max(prefill_peak, decode_peak), graphs, max(SLACK_MIN, int(total * SLACK_SHARE)))
    log.info("profile run: prefill of %d tokens peaks at %s, decode of %d rows at %s; reserve %s",
             tokens, gib(prefill_peak), rows, gib(decode_peak), reserve.describe())
    return reserve


def check_after_start(config: EngineConfig, reserve: Reserve) -> None:
    """Refuse to start when what the engine holds now (KV cache, pool, graphs, buffers) leaves
    less free than the eager steps' measured peak: a forward would run out of memory later."""
    device = torch.device(config.device)
    _settle(device)
    free, _ = torch.cuda.mem_get_info(device)
    if free < reserve.activations:
        raise ValueError(f"after the KV cache, adapter pool and CUDA graphs {gib(free)} is free on {device}, less "
                         f"than the {gib(reserve.activations)} the largest step was measured to need; lower "
                         f"--kv-cache-memory-fraction or --adapter-pool-bytes")
    log.info("memory after start: %s free for steps that peak at %s", gib(free), gib(reserve.activations))


def _step_peak(runner, seqs: list[Sequence], num_tokens: list[int], device: torch.device) -> int:
    torch.cuda.synchronize(device)
    held = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    runner.execute(seqs, num_tokens)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - held


def _request(rid: str, prompt: list[int], sampling: SamplingParams) -> Sequence:
    request = GenerationRequest(rid, tuple(prompt), None, sampling, StoppingCriteria(max_new_tokens=2))
    return Sequence.create(request, None, None, None)


def _prompt(rid: str, n: int, vocab: int, blocks: BlockManager, prompt_logprobs: int) -> Sequence:
    ids = torch.randint(0, vocab, (n,)).tolist()
    seq = _request(rid, ids, SamplingParams(logprobs=True, top_logprobs=MAX_TOP_LOGPROBS,
                                            prompt_logprobs=prompt_logprobs))
    blocks.grow(seq.block_table, n)
    return seq


def _decoding(rid: str, vocab: int, blocks: BlockManager) -> Sequence:
    """A sequence one token into its output, every sampling table on."""
    sampling = SamplingParams(temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1,
                              presence_penalty=0.5, frequency_penalty=0.5, logprobs=True,
                              top_logprobs=MAX_TOP_LOGPROBS)
    ids = torch.randint(0, vocab, (2,)).tolist()
    seq = _request(rid, ids[:1], sampling)
    seq.token_ids.append(ids[1])
    seq.num_computed = 1
    blocks.grow(seq.block_table, 2)
    return seq


def _elem(config: EngineConfig) -> int:
    return torch.tensor([], dtype=config.torch_dtype).element_size()


def _settle(device: torch.device) -> None:
    gc.collect()
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
