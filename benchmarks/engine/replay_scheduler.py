"""The scheduler alone (no model) over bench_textgen's requests: preemptions and recomputed tokens
by admission headroom, for a KV cache of a given size.

Each step the real Scheduler picks its sequences; they compute their chunks, a sequence whose
chunk ends its pending tokens gets one token, and a sequence with all its tokens leaves. What it
shows is where KV pressure makes the engine preempt, and what admission headroom
(``SchedulerConfig.admission_headroom_tokens``) does to that, without a GPU: a preempted sequence
recomputes its whole context in one long step that every other row's next token waits for.
Step times are not modelled. Two kinds of step are counted:
- eager steps, which no CUDA graph holds (the engine's rule, ``cuda_graphs.graph_size``: more rows
  than the largest captured graph, a prefill chunk past ``step_plan.graph_span`` such as a recomputed
  context or a long prompt, or nothing to sample), with the decode tokens made in them: once those
  are over 1% of all tokens, the per-token p99 is such a step's time;
- steps whose LoRA calls take the prefill kernels, one 128-row tile a segment (the launcher's
  ``is_decode``, for Distinct: a segment a sequence in eager steps, the tables' capacity in graphs).

    python -m benchmarks.engine.replay_scheduler --max-batch 128 --num-requests 384 --max-len 2048 \\
        --num-kv-blocks 4700 --headroom 0,16,64
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from benchmarks.engine.bench_textgen import request_set
from loraplex.inference_server.engine.block_manager import BlockManager
from loraplex.inference_server.engine.cuda_graphs import GraphShape, default_sizes, graph_size
from loraplex.inference_server.engine.request import GenerationRequest, StoppingCriteria
from loraplex.inference_server.engine.scheduler import Scheduler, SchedulerConfig
from loraplex.inference_server.engine.sequence import Sequence
from loraplex.inference_server.engine.step_plan import SpanPlan
from loraplex.kernels.cuda._plan import MODE_SGMV, is_decode


@dataclass(frozen=True)
class Replay:
    steps: int
    preemptions: int
    recomputed_tokens: int  # context thrown away by preemptions (computed again later)
    eager_steps: int  # steps no CUDA graph holds
    waited: float  # the share of decode tokens made in an eager step
    prefill_kernel_steps: int  # steps whose LoRA calls take the prefill kernels (Distinct)


def replay(lengths: list[tuple[int, int]], max_batch: int, budget: int, num_blocks: int, block_size: int,
           headroom: int, rank: int = 16) -> Replay:
    """Run (prompt, new tokens) requests, all queued at the start, through the scheduler. rank: the
    adapters' rank cap, for the LoRA kernels' path choice (bench_textgen's --max-lora-rank)."""
    scheduler = Scheduler(SchedulerConfig(max_batch, budget, headroom), BlockManager(num_blocks, block_size,
                                                                                        prefix_caching=False))
    for i, (prompt, new) in enumerate(lengths):
        request = GenerationRequest(f"r{i}", tuple(range(3, 3 + prompt)),
                                    stopping=StoppingCriteria(max_new_tokens=new, ignore_eos=True))
        seq = Sequence(request, None, None, None)
        seq.token_ids = list(request.prompt_token_ids)
        scheduler.add(seq)
    # the engine's graphs (bench_textgen: max_model_len = the token budget); block tables as wide as contexts
    shape = GraphShape(default_sizes(max_batch, budget), -(-budget // block_size), block_size, 0)
    steps = recomputed = eager_steps = prefill_kernel_steps = decoded = waited = 0
    while scheduler.has_work():
        batch = scheduler.schedule()
        steps += 1
        recomputed += sum(len(s.token_ids) - 1 for s in batch.preempted)
        spans = [SpanPlan(0, n, s.num_computed + n, (0,) * -(-(s.num_computed + n) // block_size))
                 for s, n in zip(batch.seqs, batch.num_tokens)]
        samples = any(s.num_computed + n >= len(s.token_ids) for s, n in zip(batch.seqs, batch.num_tokens))
        eager = graph_size(shape, sum(batch.num_tokens), spans, samples) is None
        eager_steps += eager
        segments = len(batch.seqs) if eager else max_batch  # Distinct's; a graph's seg has the capacity
        prefill_kernel_steps += not is_decode(sum(batch.num_tokens), MODE_SGMV, segments, rank)
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed += n
            if seq.num_computed < len(seq.token_ids):
                continue
            seq.token_ids.append(0)
            if n == 1:
                decoded += 1
                waited += eager
            if seq.num_output >= seq.request.stopping.max_new_tokens:
                scheduler.remove(seq)
    return Replay(steps, scheduler.num_preemptions, recomputed, eager_steps, waited / max(decoded, 1),
                  prefill_kernel_steps)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-batch", type=int, default=128)
    ap.add_argument("--num-requests", type=int, default=384)
    ap.add_argument("--max-len", type=int, default=2048, help="also the step's token budget, as in bench_textgen")
    ap.add_argument("--num-kv-blocks", type=int, required=True, help="the engine's (bench_textgen prints it)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--headroom", default="0,64", help="admission headroom tokens to compare, comma-separated")
    ap.add_argument("--max-lora-rank", type=int, default=16, help="the adapters' rank cap, as bench_textgen's")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    lengths = request_set(args.num_requests, args.max_len, args.seed)
    print("| headroom (tokens) | steps | preemptions | recomputed tokens | eager steps (no graph holds them) "
          "| decode tokens made in them | steps on the LoRA prefill kernels (Distinct) |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for headroom in (int(h) for h in args.headroom.split(",")):
        r = replay(lengths, args.max_batch, args.max_len, args.num_kv_blocks, args.block_size, headroom,
                   args.max_lora_rank)
        print(f"| {headroom} | {r.steps} | {r.preemptions} | {r.recomputed_tokens} | {r.eager_steps} | "
              f"{r.waited:.2%} | {r.prefill_kernel_steps} |")


if __name__ == "__main__":
    main()
