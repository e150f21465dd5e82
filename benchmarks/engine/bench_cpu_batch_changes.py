"""CPU engine under continuous arrivals: what a decode step costs right after the batch
changes (a request finished, another with a different adapter joined) against a steady one.

SmolLM2-135M-shaped model with random weights, float32, batch 8, rank-16 adapters on all 7
projections. Eight requests start together; each time one finishes, a new request joins
with an adapter that is resident in the pool but not running (``--cold``: one never
loaded, so the pool is written first). Step times are engine steps (``LLMEngine.step``).

    python -m benchmarks.engine.bench_cpu_batch_changes [--cold] [--results benchmarks/RESULTS.md]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch


from benchmarks.common.random_adapters import RandomAdapterSource
from benchmarks.common.results import record_results

from loraplex.inference_server.engine.async_engine import AsyncEngine
from loraplex.inference_server.engine.config import EngineConfig
from loraplex.inference_server.engine.factory import assemble
from loraplex.inference_server.engine.request import GenerationRequest, SamplingParams, StoppingCriteria
from loraplex.inference_server.model.checkpoint import ModelSource
from loraplex.inference_server.model.loading import load_checkpoint
from loraplex.inference_server.model.weights import build_model

BATCH, ARRIVALS = 8, 8


def run(cold: bool) -> tuple[list[float], list[float]]:
    """(steady decode step ms, first decode step ms after each change of the batch)."""
    ckpt = load_checkpoint(ModelSource(format="dummy", dummy="smollm2-135m", seed=0), torch.float32)
    model = build_model(ckpt.config, ckpt.iter_tensors(), "cpu", torch.float32)
    cfg = EngineConfig(device="cpu", dtype="float32", max_num_seqs=BATCH, max_num_batched_tokens=512,
                       max_model_len=512, adapter_pool_bytes=512 * 2**20)
    engine = assemble(AsyncEngine, cfg, model, ckpt.config, ckpt.tokenizer, RandomAdapterSource(ckpt.config, 16))
    core, manager = engine._core, engine._manager
    if not cold:
        for i in range(BATCH + ARRIVALS):
            manager.release(manager.acquire(f"a{i}"))

    def add(i: int, new_tokens: int) -> None:
        request = GenerationRequest(f"r{i}", tuple(range(5, 40)), f"a{i}", SamplingParams(),
                                    StoppingCriteria(max_new_tokens=new_tokens, ignore_eos=True))
        core.add_request(request, manager.acquire(f"a{i}"))

    for i in range(BATCH):
        add(i, 20 + 5 * i)
    steady, after_change = [], []
    joined, replaced = BATCH, False
    while core.has_work():
        prefill = bool(core.scheduler.waiting) or any(s.num_pending > 1 for s in core.scheduler.running)
        t0 = time.perf_counter()
        events = core.step()
        ms = (time.perf_counter() - t0) * 1e3
        if prefill:  # a newcomer's prompt: the next decode step runs a changed batch
            replaced = replaced or joined > BATCH
        elif len(core.scheduler.running) == BATCH:
            (after_change if replaced else steady).append(ms)
            replaced = False
        for event in events:
            if event.finish_reason is not None and joined < BATCH + ARRIVALS:
                add(joined, 30)
                joined += 1
    return steady[1:], after_change


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cold", action="store_true", help="newcomers' adapters are loaded into the pool first")
    ap.add_argument("--results", type=Path, default=None)
    args = ap.parse_args()
    steady, after = run(args.cold)
    rows = ["| decode step (batch 8) | median ms | steps |", "| --- | ---: | ---: |",
            f"| steady | {statistics.median(steady):.1f} | {len(steady)} |",
            f"| first after a request was replaced | {statistics.median(after):.1f} | {len(after)} |"]
    print("\n".join(rows))
    if args.results:
        kind = "not yet loaded" if args.cold else "resident, not running"
        record_results(args.results, f"CPU engine under continuous arrivals (newcomers' adapters {kind})",
                       "python -m benchmarks.engine.bench_cpu_batch_changes " + " ".join(sys.argv[1:]), rows)


if __name__ == "__main__":
    main()
