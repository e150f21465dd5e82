"""What a call costs the first time a process makes it, against the same call again: the stalls
a serving engine pays mid-run when a step meets a kernel or a shape for the first time (every
other stream waits for that step).

- LoRA prefill kernels: the first ``add_lora_slices`` call on the prefill path (a 1024-row chunk)
  compiles their modules; the decode kernels are compiled by the CUDA-graph capture at start.
- Prefill attention (one SDPA call per sequence): whole prompts (causal) and chunks over a cached
  prefix (an explicit mask), each shape new, as PyTorch chooses the backend (cuDNN's on Hopper,
  which builds a plan per shape) and as ``model/attention.py`` calls it (its backends).

    python -m benchmarks.engine.bench_cold_calls [--shapes 40]
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from benchmarks.kernels.bench_add_lora import DT, build
from loraplex.inference_server.model import attention
from loraplex.kernels import cuda as kcuda

HEADS, HEADS_KV, DIM = 32, 8, 128


def timed(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def lora_first_call() -> tuple[float, float]:
    """(first, second) add_lora on the prefill path, ms: 1024 rows of one adapter, 4096 x 4096, rank 16."""
    gen = torch.Generator().manual_seed(0)
    pool, sets = build(4096, 4096, 16, [0] * 1024, 1, gen)
    ws = torch.empty(1, 1024, 16, device="cuda", dtype=DT)
    x = torch.randn(1024, 4096, device="cuda", dtype=DT)
    y = torch.zeros(1024, 4096, device="cuda", dtype=DT)
    s = sets[0]

    def call():
        kcuda.add_lora_slices(y, x, s.ops(pool, 4096, ws), s.seg, row_slot=s.row_slot)
    return timed(call), timed(call)


def attention_shapes(n: int, seed: int) -> list[tuple[int, int]]:
    """(query rows, keys) of n distinct prefill spans: half whole prompts, half chunks past a prefix."""
    gen = torch.Generator().manual_seed(seed)
    shapes: set[tuple[int, int]] = set()
    while len(shapes) < n:
        q = int(torch.randint(2, 512, (1,), generator=gen))
        prefix = 0 if len(shapes) % 2 == 0 else int(torch.randint(16, 1024, (1,), generator=gen)) // 16 * 16
        shapes.add((q, q + prefix))
    return sorted(shapes)


def span(q_len: int, ctx: int):
    """A span's (PyTorch's SDPA call, model/attention.py's call) over the same random operands."""
    q = torch.randn(1, HEADS, q_len, DIM, device="cuda", dtype=DT)
    k = torch.randn(1, HEADS_KV, ctx, DIM, device="cuda", dtype=DT)
    v = torch.randn_like(k)
    causal = q_len == ctx
    mask = None if causal else torch.ones(q_len, ctx, dtype=torch.bool, device="cuda").tril(ctx - q_len)
    scale = DIM ** -0.5

    def pytorch():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, is_causal=causal,
                                              enable_gqa=True)

    def ours():
        with attention.sdpa_backends(q.device):
            return attention.attend(q, k, v, mask, scale, None, causal=causal)
    return pytorch, ours


def attention_rows(shapes: list[tuple[int, int]]) -> list[tuple[str, float, float, float]]:
    """(way, first calls ms in all, the same calls again ms in all, worst first call ms) per way;
    each meets the shapes shifted by its own offset, so neither finds the other's plans."""
    rows = []
    for offset, name in enumerate(("PyTorch's choice", "model/attention.py")):
        firsts, repeats = [], []
        for q_len, ctx in shapes:
            call = span(q_len + offset, ctx + offset)[offset]
            firsts.append(timed(call))
            repeats.append(timed(call))
        rows.append((name, sum(firsts), sum(repeats), max(firsts)))
    return rows


def largest_difference(shapes: list[tuple[int, int]]) -> float:
    """max |PyTorch's choice - model/attention.py's| over the shapes (bf16 outputs)."""
    worst = 0.0
    for q_len, ctx in shapes:
        pytorch, ours = span(q_len, ctx)
        worst = max(worst, (pytorch().float() - ours().float()).abs().max().item())
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", type=int, default=40, help="distinct prefill attention shapes")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(torch.cuda.get_device_name(), flush=True)
    first, again = lora_first_call()
    print(f"add_lora, prefill path (1024 rows): first call {first:.1f} ms, again {again:.2f} ms", flush=True)
    for call in span(16, 16):  # the SDPA libraries' own first load, outside the comparison
        call()
    shapes = attention_shapes(args.shapes, args.seed)
    print(f"prefill attention, {len(shapes)} new shapes (query rows 2-511, prefixes 0-1008), ms in all:")
    print("| backend | first calls | the same calls again | worst first call |")
    print("| --- | ---: | ---: | ---: |")
    for name, firsts, repeats, worst in attention_rows(shapes):
        print(f"| {name} | {firsts:.1f} | {repeats:.1f} | {worst:.1f} |", flush=True)
    print(f"largest difference between the two (bf16): {largest_difference(shapes):.4f}")


if __name__ == "__main__":
    main()
