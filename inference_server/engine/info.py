"""What the engine tells the edge about itself: fixed facts and live counts."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class EngineInfo:
    model_name: str
    dtype: str
    device: str
    max_context_len: int
    max_batch_size: int
    max_new_tokens_limit: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_lora_rank: int
    # a text prompt longer than this is past the context window whatever it says (None: no bound)
    max_prompt_chars: int | None = None
    # streams the engine holds at once, running and waiting (--max-num-seqs + --max-waiting): a
    # request of more choices could never have them all admitted (None: no bound known)
    max_streams: int | None = None


@dataclass(frozen=True, slots=True)
class EngineStats:
    num_running: int
    num_waiting: int
    free_kv_blocks: int
    total_kv_blocks: int
    resident_adapters: int
    preemptions: int
    running_adapters: tuple[str, ...] = ()  # adapter ids with a running request (sorted; no base model)
    waiting_adapters: tuple[str, ...] = ()  # adapter ids with a queued request, or one waiting for pool space
    prefix_queried_tokens: int = 0  # prompt tokens of admitted requests, looked up in the prefix cache
    prefix_hit_tokens: int = 0  # of those, served from cached KV blocks (not computed)
    # distinct adapters of the served rank the device pool holds at once (engine/lora_capacity.py);
    # 0: an engine without a pool
    max_lora: int = 0
