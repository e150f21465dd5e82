"""Decode attention over the paged KV cache on the GPU: the paged_decode kernel against the
HBM roofline of the K/V bytes it must read.

Shapes: a batch of sequences of one model's attention (7B: 32 heads of 128, no GQA; SmolLM2:
9 query / 3 kv heads of 64), every block of every sequence at a random place in a cache much
larger than L2. Device time from CUDA events around replays of a CUDA graph of several calls
(each call one layer's cache, rotating), median over replays. Each configuration is checked
against torch's SDPA on the gathered context before it is timed.

    python3 -m benchmarks.kernels.bench_paged_decode [--unrolls 2,4] [--contexts 600,1500]

Runs on the kernel API of older commits too (no ``unroll`` argument: the built-in one), so a
before/after pair can time two checkouts with the same script: from this checkout's root,
``PYTHONPATH=<other tree> python3 -m benchmarks.kernels.bench_paged_decode`` imports that tree's
``loraplex`` (the benchmarks package puts this checkout's root last on ``sys.path``).
"""

from __future__ import annotations

import argparse
import inspect
import math
from dataclasses import dataclass

import torch

from loraplex.kernels.cuda import paged_decode as pd
from benchmarks.kernels.bench_add_lora import time_graph
from benchmarks.common.gpu_ceilings import measure_copy_bandwidth

BLOCK = 16
LAYERS = 8  # calls per graph, each over its own layer's cache


@dataclass(frozen=True)
class Shape:
    name: str
    heads: int
    kv_heads: int
    dim: int


SHAPES = {"7b": Shape("7b", 32, 32, 128), "smollm2": Shape("smollm2", 9, 3, 64)}


def make_case(shape: Shape, batch: int, context: int, gen: torch.Generator):
    """q, per-layer K/V caches, shuffled block tables and lengths (jittered +-25% around context)."""
    lens = [max(1, int(context * (0.75 + 0.5 * torch.rand(1, generator=gen).item()))) for _ in range(batch)]
    blocks = [math.ceil(n / BLOCK) for n in lens]
    total = sum(blocks)
    caches = [(torch.randn(total, BLOCK, shape.kv_heads, shape.dim, device="cuda", dtype=torch.bfloat16),
               torch.randn(total, BLOCK, shape.kv_heads, shape.dim, device="cuda", dtype=torch.bfloat16))
              for _ in range(LAYERS)]
    order = torch.randperm(total, generator=gen).tolist()
    tables = torch.zeros(batch, max(blocks), dtype=torch.int32)
    for i, nb in enumerate(blocks):
        tables[i, :nb] = torch.tensor([order.pop() for _ in range(nb)], dtype=torch.int32)
    q = torch.randn(batch, shape.heads, shape.dim, device="cuda", dtype=torch.bfloat16)
    rows = torch.arange(batch, dtype=torch.int32, device="cuda")
    return q, caches, rows, tables.cuda(), torch.tensor(lens, dtype=torch.int32, device="cuda")


def sdpa_reference(q, k, v, tables, lens, i: int) -> torch.Tensor:
    n = int(lens[i])
    t = torch.arange(n, device="cuda")
    slots = tables[i].long()[t // BLOCK]
    group = q.shape[1] // k.shape[2]
    keys = k[slots, t % BLOCK].repeat_interleave(group, 1).transpose(0, 1).float()  # [H, n, D]
    vals = v[slots, t % BLOCK].repeat_interleave(group, 1).transpose(0, 1).float()
    return torch.nn.functional.scaled_dot_product_attention(q[i].float()[:, None], keys, vals)[:, 0]


def time_variant(shape: Shape, batch: int, context: int, unroll: int | None, reps: int,
                 bandwidth: float) -> dict:
    gen = torch.Generator().manual_seed(batch * 7919 + context)
    q, caches, rows, tables, lens = make_case(shape, batch, context, gen)
    scale = shape.dim**-0.5
    splits = pd.num_splits_for(int(lens.max()))
    ws = pd.DecodeWorkspace.allocate(batch, shape.heads, shape.dim, int(lens.max()), q.device)
    out = torch.zeros_like(q)
    extra = {} if unroll is None else {"unroll": unroll}

    def call(layer: int) -> None:
        k, v = caches[layer]
        pd.paged_decode_attention(out, q, k, v, rows, tables, lens, scale, splits, ws, **extra)

    call(0)
    torch.cuda.synchronize()
    for i in (0, batch // 2, batch - 1):
        ref = sdpa_reference(q, *caches[0], tables, lens, i)
        err = (out[i].float() - ref).abs().max().item()
        if err > 2e-2 * max(1.0, ref.abs().max().item()):
            raise AssertionError(f"{shape.name} B{batch} ctx{context} unroll {unroll}: error {err:.3g}")
    us = time_graph([lambda layer=layer: call(layer) for layer in range(LAYERS)], LAYERS, reps)
    kv_bytes = 2 * int(lens.sum()) * shape.kv_heads * shape.dim * 2
    return {"shape": shape.name, "batch": batch, "context": context, "unroll": unroll, "us": us,
            "kv_mb": kv_bytes / 1e6, "tbps": kv_bytes / us / 1e6, "roofline_us": kv_bytes / bandwidth * 1e6}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="7b,smollm2")
    ap.add_argument("--batches", default="32")
    ap.add_argument("--contexts", default="600,1500")
    ap.add_argument("--unrolls", default="default", help="comma list of tokens in flight per lane, or 'default'")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    has_unroll = "unroll" in inspect.signature(pd.paged_decode_attention).parameters
    unrolls = [None] if args.unrolls == "default" or not has_unroll else [int(u) for u in args.unrolls.split(",")]
    bandwidth = measure_copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()}: copy bandwidth {bandwidth / 1e12:.2f} TB/s (the roofline's)")
    print("| shape | batch | context | unroll | us per layer | KV MB | TB/s | roofline us | / roofline |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in args.shapes.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            for context in (int(c) for c in args.contexts.split(",")):
                for unroll in unrolls:
                    r = time_variant(SHAPES[name], batch, context, unroll, args.reps, bandwidth)
                    label = "built-in" if r["unroll"] is None else r["unroll"]
                    print(f"| {r['shape']} | {batch} | {context} | {label} | {r['us']:.1f} | {r['kv_mb']:.1f} | "
                          f"{r['tbps']:.2f} | {r['roofline_us']:.1f} | {r['us'] / r['roofline_us']:.2f}x |",
                          flush=True)


if __name__ == "__main__":
    main()
