"""Where an eager engine step's time goes: torch.profiler around the first few eager steps.

An engine step that no captured graph covers (more rows than the largest graph: a long prompt chunk
or a preempted sequence's recompute beside the decodes) runs eagerly; at max batch 256 such steps
took 150-220 ms against ~20 ms for a graph step (H100, 2026-12-07). ``wrap_eager_steps`` profiles
the first ``count`` of them and prints the operators by host time and by device time, so the fix
aims at what the profile shows rather than a guess.
"""

from __future__ import annotations

import time

import torch
from torch.profiler import ProfilerActivity, profile

from loraplex.inference_server.engine.cuda_graphs import MAX_GRAPH_ROWS


def wrap_eager_steps(runner, count: int, min_seqs: int, rows: int = 10):
    """Profile ``runner.execute`` for its first ``count`` steps of more than MAX_GRAPH_ROWS tokens
    over at least ``min_seqs`` sequences (decodes beside a chunk, not the first prompts alone);
    returns a function that profiles the next ``count`` again (call it at each workload's start)."""
    execute, left = runner.execute, [count]

    def call(seqs, num_tokens, *rest):
        if left[0] <= 0 or sum(num_tokens) <= MAX_GRAPH_ROWS or len(seqs) < min_seqs:
            return execute(seqs, num_tokens, *rest)
        left[0] -= 1
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            out = execute(seqs, num_tokens, *rest)
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        spans = sum(1 for n in num_tokens if n > 1)
        print(f"eager step: {len(seqs)} seqs, {sum(num_tokens)} tokens, {spans} prompt spans; "
              f"{wall * 1e3:.1f} ms with the profiler on", flush=True)
        averages = prof.key_averages()
        print(averages.table(sort_by="self_cpu_time_total", row_limit=rows), flush=True)
        print(averages.table(sort_by="self_cuda_time_total", row_limit=rows), flush=True)
        return out

    runner.execute = call

    def rearm() -> None:
        left[0] = count

    return rearm
