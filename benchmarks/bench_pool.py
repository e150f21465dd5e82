"""Adapter pool on the GPU: load latency per tier, and decode step time while adapters load.

    python benchmarks/bench_pool.py [--layers 32] [--results benchmarks/RESULTS.md]

7B-shaped Llama (hidden 4096, 32 layers, 32 heads, intermediate 11008, vocab 32000) with
random bf16 weights made on the GPU, rank-16 adapters on all 7 projections (~80 MB each).
The adapter source is in memory (the bytes a Redis hit would hand over), so "source" rows
time validation + packing + the host-to-device copy, without network.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from safetensors.torch import save

sys.path.insert(0, str(Path(__file__).resolve().parent))
from results import append_results  # noqa: E402

from inference_server.engine.async_engine import AsyncEngine  # noqa: E402
from inference_server.engine.config import EngineConfig  # noqa: E402
from inference_server.engine.factory import assemble  # noqa: E402
from inference_server.engine.request import GenerationRequest, StoppingCriteria  # noqa: E402
from inference_server.lora.peft_format import parse_adapter_files  # noqa: E402
from inference_server.lora.source import AdapterFiles, make_info  # noqa: E402
from inference_server.model.config import ModelConfig  # noqa: E402
from inference_server.model.dummy import byte_level_tokenizer  # noqa: E402
from inference_server.model.llama import LlamaForCausalLM  # noqa: E402

PROJ = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
        "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


class MemorySource:
    """AdapterSource over in-memory PEFT files: every id serves the same bytes."""

    def __init__(self, files: dict[str, bytes], base: ModelConfig) -> None:
        self.files, self.spec = files, parse_adapter_files(files, base)

    def resolve(self, adapter_id: str) -> AdapterFiles:
        return AdapterFiles(make_info(adapter_id, self.files, self.spec, 0.0), self.spec, self.files)


def peft_files(cfg: ModelConfig, rank: int) -> dict[str, bytes]:
    shapes = cfg.projection_shapes()
    tensors = {}
    for layer in range(cfg.num_layers):
        for proj, parent in PROJ.items():
            fan_in, fan_out = shapes[proj]
            stem = f"base_model.model.model.layers.{layer}.{parent}.{proj}"
            tensors[f"{stem}.lora_A.weight"] = torch.randn(rank, fan_in, dtype=torch.bfloat16) * 0.01
            tensors[f"{stem}.lora_B.weight"] = torch.randn(fan_out, rank, dtype=torch.bfloat16) * 0.01
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJ)}
    import json

    return {"adapter_config.json": json.dumps(config).encode(), "adapter_model.safetensors": save(tensors)}


def build(cfg: ModelConfig, rank: int) -> AsyncEngine:
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    for name, p in model.named_parameters():
        torch.nn.init.ones_(p) if name.endswith("norm.weight") else torch.nn.init.normal_(p, 0.0, 0.02)
    model.init_rotary("cuda")
    model.eval().requires_grad_(False)
    config = EngineConfig(device="cuda", dtype="bfloat16", max_num_seqs=32, max_num_batched_tokens=4096,
                          adapter_pool_bytes=2 << 30, adapter_host_cache_bytes=6 << 30, num_kv_blocks=4096)
    source = MemorySource(peft_files(cfg, rank), cfg)
    return assemble(AsyncEngine, config, model, cfg, byte_level_tokenizer(cfg.vocab_size), source)


def timed_acquire(mgr, adapter_id: str) -> float:
    t0 = time.perf_counter()
    mgr.release(mgr.acquire(adapter_id))
    return time.perf_counter() - t0


def stage_times(engine, cfg: ModelConfig) -> dict[str, float]:
    """Where a source load goes: validation, safetensors decode, packing (CPU, pinned)."""
    from inference_server.lora.tensor_views import tensor_views

    from inference_server.lora.packing import pack_adapter, plan_layout

    files = engine._manager.source.files
    out = {}
    t0 = time.perf_counter()
    spec = parse_adapter_files(files, cfg)
    out["validate"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    tensors = tensor_views(files["adapter_model.safetensors"])
    out["tensor views of the bytes"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    buffer, _ = engine._manager.host.reserve(plan_layout(spec, cfg).num_elements)
    pack_adapter(spec, tensors, cfg, torch.bfloat16, out=buffer)
    out["pack (transpose into the pinned arena)"] = time.perf_counter() - t0
    return out


def step_times(core, n: int) -> list[float]:
    out = []
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        core.step()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--results", default=None)
    args = parser.parse_args()
    cfg = ModelConfig(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                      num_layers=args.layers, num_heads=32, num_kv_heads=32, head_dim=128,
                      max_position_embeddings=4096, name="llama-7b-dummy")
    engine = build(cfg, args.rank)
    mgr, core = engine._manager, engine._core
    timed_acquire(mgr, "warm")  # first call: allocator, pinned buffers
    mgr.invalidate("warm")
    source_s = [timed_acquire(mgr, f"cold-{i}") for i in range(30)]  # source -> host tier -> pool
    evicted_before = mgr.stats().counters["host_hits"]
    host_s = [timed_acquire(mgr, f"cold-{i}") for i in range(5)]  # evicted from the pool by now
    assert mgr.stats().counters["host_hits"] - evicted_before == 5, "expected host-tier hits"
    resident_s = [timed_acquire(mgr, "cold-29") for _ in range(5)]
    entry = mgr.host.lease("cold-29")
    mb = entry.num_bytes / 1e6
    mgr.host.release(entry)
    stages = stage_times(engine, cfg)
    # decode step time of 32 running requests, with and without 20 adapters loading
    for i in range(32):
        request = GenerationRequest(f"d{i}", tuple(range(5, 133)), f"run-{i % 4}",
                                    stopping=StoppingCriteria(max_new_tokens=400, ignore_eos=True))
        core.add_request(request, mgr.acquire(request.adapter_id))
    step_times(core, 3)  # prefill + warm-up
    idle = step_times(core, 30)
    loader = threading.Thread(target=lambda: [timed_acquire(mgr, f"load-{i}") for i in range(20)])
    loader.start()
    busy = []
    while loader.is_alive():
        busy += step_times(core, 1)
    loader.join()
    ms = lambda xs: statistics.median(xs) * 1e3  # noqa: E731
    rise = (ms(busy) / ms(idle) - 1) * 100
    table = [
        "| measure | median | target |", "| --- | ---: | ---: |",
        f"| adapter size (bf16, rank {args.rank}, 7 projections x {args.layers} layers) | {mb:.1f} MB | |",
        f"| acquire, resident in the pool | {ms(resident_s):.3f} ms | |",
        f"| acquire, host tier -> pool (pinned H2D on the side stream) | {ms(host_s):.2f} ms | <= 3 ms |",
        f"| acquire, source bytes -> validate, pack -> pool | {ms(source_s):.1f} ms | <= 100 ms (Redis hit) |",
        *[f"| source load stage: {k} | {v * 1e3:.1f} ms | |" for k, v in stages.items()],
        f"| decode step, batch 32, no loads | {ms(idle):.2f} ms | |",
        f"| decode step, batch 32, 20 adapters loading ({len(busy)} steps) | {ms(busy):.2f} ms | |",
        f"| step time rise while loading | {rise:+.1f}% | <= +5% |",
    ]
    print("\n".join(table))
    if args.results:
        append_results(Path(args.results), "Adapter pool on the GPU (7B-shaped, eager engine)",
                       " ".join(["python", *sys.argv]), table)


if __name__ == "__main__":
    main()
