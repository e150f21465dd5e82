"""Wire an engine together: load the model, size the KV cache and adapter pool, build the parts."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from loraplex.adapter_store.format.files import AdapterSource
from loraplex.inference_server.engine.block_manager import BlockManager
from loraplex.inference_server.engine.config import EngineConfig
from loraplex.inference_server.engine.cuda_graphs import default_sizes
from loraplex.inference_server.engine.grammar import GrammarCompiler
from loraplex.inference_server.engine.info import EngineInfo
from loraplex.inference_server.engine.llm_engine import LLMEngine
from loraplex.inference_server.engine.lora_capacity import LoraCapacity, largest_adapter_bytes
from loraplex.inference_server.engine.memory_plan import (MemoryPlan, Reserve, kv_block_bytes, plan_memory,
                                                           unmeasured_reserve)
from loraplex.inference_server.engine.model_runner import ModelRunner, RunnerOptions
from loraplex.inference_server.engine.profile_run import check_after_start, measure_reserve
from loraplex.inference_server.engine.scheduler import SchedulerConfig
from loraplex.inference_server.lora.local_directory import LocalAdapterDirectory
from loraplex.inference_server.lora.managed_adapters import ManagedAdapters
from loraplex.inference_server.lora.pool.adapter_pool import AdapterPool
from loraplex.inference_server.model.checkpoint import ModelSource
from loraplex.inference_server.model.config import ModelConfig
from loraplex.inference_server.model.loading import load_checkpoint
from loraplex.inference_server.model.tokenizer import Tokenizer
from loraplex.inference_server.model.weights import build_model

log = logging.getLogger(__name__)


def build_local_engine(cls, config: EngineConfig, model: ModelSource, adapters, progress: bool = True):
    """The single-process engine: load the checkpoint onto ``config.device`` and assemble.
    ``adapters``: an AdapterSource, or a folder path for a LocalAdapterDirectory."""
    ckpt = load_checkpoint(model, config.torch_dtype, progress=progress)
    log.info("loading %s (%s) on %s", ckpt.description, config.dtype, config.device)
    module = build_model(ckpt.config, ckpt.iter_tensors(), config.device, config.torch_dtype)
    return assemble(cls, config, module, ckpt.config, ckpt.tokenizer, adapter_source(adapters, ckpt.config, config))


def adapter_source(adapters, model_config: ModelConfig, config: EngineConfig) -> AdapterSource:
    """An AdapterSource from what build_engine was given: a source, a folder path, or a
    callable that makes a source from the loaded model's config."""
    if isinstance(adapters, (str, Path)):
        return LocalAdapterDirectory(adapters, model_config, config.max_lora_rank)
    if isinstance(adapters, AdapterSource):
        return adapters
    if callable(adapters):
        return adapters(model_config)
    raise TypeError(f"adapters: expected an AdapterSource, a folder path or a factory of a source, "
                    f"got {type(adapters).__name__}")


def assemble(
    cls, config: EngineConfig, module: nn.Module, model_config: ModelConfig, tokenizer: Tokenizer,
    source: AdapterSource,
    manager_factory=AdapterPool, runner_factory=None,
):
    """Build the engine around an already loaded model (tests use this directly).

    ``manager_factory`` (AdapterPool's arguments) and ``runner_factory`` (module, model
    config, block manager, adapter manager, max seqs, max tokens) let tensor parallelism
    substitute its rank-0 manager and runner."""
    dtype = config.torch_dtype
    elem = torch.tensor([], dtype=dtype).element_size()
    window = min(config.max_model_len or model_config.max_position_embeddings, model_config.max_position_embeddings)
    graph_sizes = runner_options(config, window).cuda_graph_sizes
    profile = None  # tensor parallelism passes its runner: its ranks cannot run a profile step alone
    if runner_factory is None and str(config.device).startswith("cuda"):
        profile = lambda: measure_reserve(module, model_config, config, window, graph_sizes)  # noqa: E731
    memory = plan_device_memory(config, model_config, elem, profile)
    num_blocks, pool_size = memory.num_kv_blocks, memory.pool_bytes
    manager = manager_factory(
        source, model_config, pool_size // elem, dtype, config.device, config.adapter_acquire_timeout_s,
        config.adapter_host_cache_bytes,
    )
    log.info("KV cache: %d blocks of %d tokens; adapter pool: %.1f MiB", num_blocks, config.block_size,
             pool_size / 2**20)
    blocks = BlockManager(num_blocks, config.block_size, config.prefix_caching)
    max_len = min(window, num_blocks * config.block_size)
    if runner_factory is not None:
        runner = runner_factory(module, model_config, blocks, manager, config.max_num_seqs,
                                config.max_num_batched_tokens)
    else:
        runner = ModelRunner(module, model_config, blocks, manager.pool, config.max_num_seqs,
                             config.max_num_batched_tokens, options=runner_options(config, max_len))
    check_required_features(config, runner)
    if profile is not None:
        check_after_start(config, memory.reserve)
    listener = runner.pool_write_listener()
    if listener is not None and manager.counts_pool_writes:  # CPU decode stacks: told what loads wrote
        manager.add_write_listener(listener)
    eos = set(model_config.eos_token_ids) | set(tokenizer.eos_token_ids)
    grammars = GrammarCompiler(tokenizer.hf_tokenizer, model_config.vocab_size, eos)
    core = LLMEngine(
        runner, tokenizer, SchedulerConfig(config.max_num_seqs, config.max_num_batched_tokens,
                                           config.admission_headroom_tokens), max_len, eos,
        manager.release, config.seed, launch_ahead=config.launch_ahead, grammars=grammars,
    )
    info = EngineInfo(
        model_name=config.served_model_name or model_config.name, dtype=config.dtype, device=str(config.device), max_context_len=max_len,
        max_batch_size=config.max_num_seqs, max_new_tokens_limit=config.max_new_tokens_limit,
        vocab_size=model_config.vocab_size, eos_token_ids=tuple(sorted(eos)), max_lora_rank=config.max_lora_rank,
        max_prompt_chars=tokenizer.max_chars_for(max_len), max_streams=config.max_streams,
    )
    capacity = LoraCapacity(largest_adapter_bytes(model_config.projection_shapes(), model_config.num_layers,
                                                  config.max_lora_rank, elem))
    adapters = ManagedAdapters(source, manager, model_config, config.max_lora_rank)
    return cls(core, manager, adapters, info, config, capacity)


def check_required_features(config: EngineConfig, runner: ModelRunner) -> None:
    """Refuse to start when CUDA graphs or launch-ahead were asked for by name (``on``, not
    ``auto``) and this runner cannot use them: a flag is never silently ignored."""
    if runner.can_launch:
        return
    if config.require_cuda_graphs:
        raise ValueError(f"--cuda-graphs on: {runner.why_eager}; use --cuda-graphs auto or off")
    if config.require_launch_ahead:
        raise ValueError(f"--launch-ahead on needs CUDA graphs: {runner.why_eager}; use --launch-ahead auto or off")


def runner_options(config: EngineConfig, max_len: int) -> RunnerOptions:
    graphs = () if config.enforce_eager else default_sizes(config.max_num_seqs, config.max_num_batched_tokens)
    return RunnerOptions(max_model_len=max_len, max_lora_rank=config.max_lora_rank, cuda_graph_sizes=graphs,
                         lora_side_stream=config.lora_side_stream)


def plan_device_memory(config: EngineConfig, cfg: ModelConfig, elem: int,
                       measure: Callable[[], Reserve] | None) -> MemoryPlan:
    """The KV cache's blocks and the adapter pool's bytes. On a GPU: shared out of what is free
    after the weights and the reserve (``measure()``, the profile run; with no ``measure``, as
    under tensor parallelism, a fixed share). On the CPU: the flags'
    sizes (``kv_cache_cpu_bytes`` when no block count is given)."""
    block = kv_block_bytes(config, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, elem)
    if not str(config.device).startswith("cuda"):
        blocks = config.num_kv_blocks or config.kv_cache_cpu_bytes // block
        if blocks < 1:
            raise ValueError(f"KV cache budget of {config.kv_cache_cpu_bytes} bytes holds no block of {block} bytes")
        return MemoryPlan(blocks, blocks * block, config.adapter_pool_bytes, None)
    free, _ = torch.cuda.mem_get_info(torch.device(config.device))
    reserve = measure() if measure is not None else unmeasured_reserve(free)
    return plan_memory(config, block, free, reserve)
