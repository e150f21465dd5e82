"""CPU engine throughput: loraplex vs transformers (+ PEFT) on SmolLM2-135M, in one run.

    python -m benchmarks.engine.bench_cpu_vs_transformers [--new-tokens 64] [--rank 16] [--repeats 3]
                                          [--results benchmarks/RESULTS.md]

Rows: loraplex batch 1 (base), loraplex batch 8 with 8 different adapters, transformers
batch 8 base model alone, transformers + PEFT batch 8 with the same 8 adapters mixed
(``adapter_names``). All generate the same number of tokens (EOS ignored), float32.
loraplex runs as served: ``AsyncEngine`` (its step loop on its own thread), adapters
resident. The four rows are measured in ``--repeats`` interleaved rounds (a machine shared
with other work drifts between rows); each row reports the median and the range, and the
load average is printed before and after.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch



from benchmarks.common.results import record_results
from benchmarks.engine.local_engine import greedy_request, load_engine, make_peft_adapter, run_all

from loraplex.inference_server.model.checkpoint import default_model_path

PROMPTS = ["Tell me a story about a dragon.", "How do planes fly?", "Give me a recipe for pancakes.",
           "What is a black hole?", "Write a poem about autumn.", "Why is the sky blue?",
           "Explain recursion.", "Plan a weekend in Rome."]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _hf_generate(model, prompts: list[list[int]], new_tokens: int, **kwargs) -> float:
    """Left-padded batch generate; returns seconds."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.no_grad():
        model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                       do_sample=False, pad_token_id=0, **kwargs)
    return time.perf_counter() - start


def _loraplex(gguf: str, adapter_dir: Path, prompts, adapters, new_tokens: int) -> float:
    engine = load_engine(gguf, adapter_dir, max_num_seqs=len(prompts))
    requests = [greedy_request(f"r{i}", p, a, new_tokens) for i, (p, a) in enumerate(zip(prompts, adapters))]
    run_all(engine, requests[:1])  # warm-up (first step)
    engine = load_engine(gguf, adapter_dir, max_num_seqs=len(prompts))
    for name in {a for a in adapters if a}:  # resident, as in steady serving: loads are not timed
        engine._manager.release(engine._manager.acquire(name))
    start = time.perf_counter()
    run_all(engine, requests)
    return time.perf_counter() - start


def _load(avg: tuple[float, float, float]) -> str:
    return "/".join(f"{v:.2f}" for v in avg)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds of the four rows")
    parser.add_argument("--results", default=None,
                        help="write this run's section into this RESULTS.md, in place of the one of its title")
    args = parser.parse_args()
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(os.cpu_count() or 1)
    gguf = default_model_path()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                              dtype=torch.float32).eval()
    adapter_dir = Path(tempfile.mkdtemp())
    names = [f"bench-{i}" for i in range(8)]
    for i, name in enumerate(names):
        make_peft_adapter(hf, adapter_dir / name, dict(r=args.rank, lora_alpha=16, target_modules=ALL), seed=i, std=0.01)
    engine = load_engine(gguf, adapter_dir)
    prompts = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    n = args.new_tokens
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    load_before = os.getloadavg()
    _hf_generate(hf, prompts, 2)  # warm-up: the first generate pays one-time set-up
    rows = [
        ("loraplex, batch 1, base model", lambda: n / _loraplex(gguf, adapter_dir, prompts[:1], [None], n)),
        ("loraplex, batch 8, 8 different adapters", lambda: 8 * n / _loraplex(gguf, adapter_dir, prompts, names, n)),
        ("transformers, batch 8, base model alone", lambda: 8 * n / _hf_generate(hf, prompts, n)),
    ]
    rates: dict[str, list[float]] = {}
    for _ in range(args.repeats):
        for name, measure in rows:
            rates.setdefault(name, []).append(measure())
    # PEFT wraps hf in place, so its rounds come after every base round
    peft_model = PeftModel.from_pretrained(hf, adapter_dir / names[0], adapter_name=names[0]).eval()
    for name in names[1:]:
        peft_model.load_adapter(adapter_dir / name, adapter_name=name)
    _hf_generate(peft_model, prompts, 2, adapter_names=names)
    for _ in range(args.repeats):
        rates.setdefault("transformers + PEFT, batch 8, 8 adapters mixed", []).append(
            8 * n / _hf_generate(peft_model, prompts, n, adapter_names=names))
    load_after = os.getloadavg()
    table = ["| configuration | generated tokens/s (median) | range |", "| --- | ---: | ---: |"]
    table += [f"| {name} | {statistics.median(v):.1f} | {min(v):.1f}-{max(v):.1f} |" for name, v in rates.items()]
    load = f"Load average (1/5/15 min) before {_load(load_before)}, after {_load(load_after)}; {args.repeats} rounds."
    print("\n".join(table))
    print(load)
    if args.results:
        title = f"CPU engine: SmolLM2-135M float32, {n} new tokens, rank {args.rank} on all 7 projections"
        command = "python -m benchmarks.engine.bench_cpu_vs_transformers " + " ".join(sys.argv[1:])
        record_results(Path(args.results), title, command, table, load)


if __name__ == "__main__":
    main()
