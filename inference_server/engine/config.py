"""Engine configuration: one typed, validated object."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Limits and sizes of one engine. ``num_kv_blocks`` None = sized from memory at start."""

    device: str = "cpu"
    dtype: str = "float32"
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory_fraction: float = 0.6  # CUDA: of what weights, step reserve and a pool in bytes leave (memory_plan.py)
    kv_cache_cpu_bytes: int = 512 * 1024 * 1024  # CPU default when num_kv_blocks is None
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    # admission leaves room for every running sequence to decode this many more tokens (scheduler.py)
    admission_headroom_tokens: int = 64
    max_model_len: int | None = None  # None = the model's context window
    max_new_tokens_limit: int = 4096
    max_waiting: int = 1024
    adapter_pool_bytes: int = 256 * 1024 * 1024
    # when set (CUDA): the pool takes this fraction of what weights, step reserve and KV leave (memory_plan.py)
    adapter_pool_memory_fraction: float | None = None
    adapter_host_cache_bytes: int = 1024 * 1024 * 1024  # pinned host tier
    max_lora_rank: int = 128
    # None: a request waits for adapter pool space as long as its caller does (queued, never refused)
    adapter_acquire_timeout_s: float | None = None
    seed: int = 0
    tensor_parallel_size: int = 1  # processes (GPUs) the model is sharded over (inference_server/parallel)
    enforce_eager: bool = False  # True: no CUDA graphs for decode steps (they apply on CUDA in 16-bit)
    lora_side_stream: bool = True  # in step graphs, each LoRA shrink runs beside its base GEMM
    # with CUDA graphs: launch the next step before reading this one's tokens
    launch_ahead: bool = True
    # asked for by name (--cuda-graphs on, --launch-ahead on): where it cannot apply (CPU, a 32-bit
    # dtype, tensor parallelism, an attention shape the decode kernel lacks) the engine refuses to
    # start, naming why, instead of running without it
    require_cuda_graphs: bool = False
    require_launch_ahead: bool = False
    # reuse the KV blocks of a prompt prefix already computed for the same adapter version
    prefix_caching: bool = True
    served_model_name: str | None = None  # the name clients see (None: the checkpoint's own name)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "max_new_tokens_limit",
                     "max_waiting", "adapter_pool_bytes", "kv_cache_cpu_bytes", "adapter_host_cache_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.admission_headroom_tokens < 0:
            raise ValueError(f"admission_headroom_tokens must be >= 0, got {self.admission_headroom_tokens}")
        if self.num_kv_blocks is not None and self.num_kv_blocks <= 0:
            raise ValueError(f"num_kv_blocks must be > 0, got {self.num_kv_blocks}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running sequence can decode each step"
            )
        if not 0 < self.kv_cache_memory_fraction <= 0.95:
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 0.95], got {self.kv_cache_memory_fraction}")
        if self.adapter_pool_memory_fraction is not None and not 0 < self.adapter_pool_memory_fraction <= 0.9:
            raise ValueError(
                f"adapter_pool_memory_fraction must be in (0, 0.9], got {self.adapter_pool_memory_fraction}"
            )
        if self.served_model_name is not None and not self.served_model_name.strip():
            raise ValueError("served_model_name must not be blank")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if not 1 <= self.max_lora_rank <= 128:
            raise ValueError(f"max_lora_rank must be in [1, 128], got {self.max_lora_rank}")

    @property
    def max_streams(self) -> int:
        """Streams an engine holds at once, running and waiting (engine/admission.py's capacity)."""
        return self.max_num_seqs + self.max_waiting

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]
