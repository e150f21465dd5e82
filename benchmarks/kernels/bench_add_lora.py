"""add_lora (shrink + expand) on the GPU: loraplex SGMV/BGMV vs the Punica paper's
PyTorch baselines (Loop over adapters, Gather-BMM) vs the HBM roofline.

Device time from CUDA events around CUDA-graph replays (each graph holds many calls,
rotating over several table sets and adapters, and over copies of x and y where one call's
would fit in L2, so repeated calls do not just re-read L2); median over replays. Every kernel result is checked against the Loop baseline first.
Columns: sgmv is add_lora_slices as the engine calls it (seg and row_slot), sgmv_seg with seg alone,
sgmv_dec / sgmv_pre forced onto the decode / prefill kernels, bgmv add_lora_slices_bgmv.

    python3 -m benchmarks.kernels.bench_add_lora [--quick] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

import torch

from loraplex.kernels import cuda as kcuda
from loraplex.kernels.operands import LoraOperands
from benchmarks.common.gpu_ceilings import measure_copy_bandwidth

HBM_BPS = 4.23e12  # measured copy bandwidth (PERF.md)
TC_FLOPS = 790e12  # measured bf16 dense matmul
DT = torch.bfloat16
WORKLOADS = ("distinct", "uniform", "skewed", "identical")


def workload_rows(name: str, batch: int, gen: torch.Generator) -> list[int]:
    """Adapter index (0..n-1) of each row, rows grouped by adapter."""
    if name == "distinct":
        return list(range(batch))
    if name == "identical":
        return [0] * batch
    if name.startswith("mixed"):  # mixed<D>: D one-row decodes (distinct adapters), then a prompt chunk
        decodes = int(name[len("mixed"):])
        return list(range(decodes)) + [decodes] * (batch - decodes)
    if name.startswith("prefill"):  # prefill<L>: segments of L rows, one adapter each
        seglen = int(name[len("prefill"):])
        return [i // seglen for i in range(batch)]
    if name == "uniform":
        n = math.ceil(math.sqrt(batch))
        return sorted(i % n for i in range(batch))
    w = 1.0 / torch.arange(1, batch + 1, dtype=torch.float64) ** 1.5
    raw = torch.multinomial(w, batch, True, generator=gen).tolist()
    ids = {a: i for i, a in enumerate(sorted(set(raw)))}
    return sorted(ids[a] for a in raw)


@dataclass
class TableSet:
    seg: torch.Tensor
    row_slot: torch.Tensor
    a_off: torch.Tensor
    b_off: torch.Tensor
    ranks: torch.Tensor
    scales: torch.Tensor
    a_stack: torch.Tensor  # [n, h_in, r] view of the pool (for the baselines)
    b_stack: torch.Tensor
    bounds: list[tuple[int, int, int]]  # (adapter, lo, hi) per segment
    row_adapter: torch.Tensor  # [T] int64

    def ops(self, pool: torch.Tensor, h_out: int, ws: torch.Tensor) -> LoraOperands:
        """The kernels' operands for one slice of width h_out at layer 0."""
        return LoraOperands(pool, self.a_off, self.b_off, self.ranks, self.scales, 0, (h_out,), ws)


def build(h_in, h_out, rank, rows_adapter, nsets, gen):
    """Pool with nsets disjoint groups of adapters (each set: A's then B's, contiguous)."""
    n = max(rows_adapter) + 1
    per = n * rank * (h_in + h_out)
    pool = torch.randn(nsets * per + 8, device="cuda", dtype=DT) * 0.05
    sets = []
    for k in range(nsets):
        a0 = k * per
        b0 = a0 + n * h_in * rank
        a_stack = pool[a0:b0].view(n, h_in, rank)
        b_stack = pool[b0 : b0 + n * rank * h_out].view(n, rank, h_out)
        counts = torch.bincount(torch.tensor(rows_adapter), minlength=n).tolist()
        seg = [0]
        for c in counts:
            seg.append(seg[-1] + c)
        bounds = [(i, seg[i], seg[i + 1]) for i in range(n) if seg[i + 1] > seg[i]]
        sets.append(TableSet(
            seg=torch.tensor(seg, dtype=torch.int32, device="cuda"),
            row_slot=torch.tensor(rows_adapter, dtype=torch.int32, device="cuda"),
            a_off=torch.tensor([[a0 + i * h_in * rank for i in range(n)]], device="cuda"),
            b_off=torch.tensor([[b0 + i * rank * h_out for i in range(n)]], device="cuda"),
            ranks=torch.full((1, n), rank, dtype=torch.int32, device="cuda"),
            scales=torch.full((1, n), 0.5, device="cuda"),
            a_stack=a_stack, b_stack=b_stack, bounds=bounds,
            row_adapter=torch.tensor(rows_adapter, device="cuda")))
    return pool, sets


def method_fn(name, pool, ws, x, y, s: TableSet, h_out):
    if name == "sgmv":  # as the engine calls it: seg and row_slot (the decode kernels' items come from row_slot)
        return lambda: kcuda.add_lora_slices(y, x, s.ops(pool, h_out, ws), s.seg, row_slot=s.row_slot)
    if name == "sgmv_seg":  # seg alone (a caller without row_slot: the decode kernels find each row's segment)
        return lambda: kcuda.add_lora_slices(y, x, s.ops(pool, h_out, ws), s.seg)
    if name in ("sgmv_dec", "sgmv_pre"):  # SGMV forced onto the decode or the prefill kernels, row_slot as the engine's
        return lambda: _forced_path(name == "sgmv_dec", y, x, s.ops(pool, h_out, ws), s.seg, s.row_slot)
    if name == "bgmv":
        return lambda: kcuda.add_lora_slices_bgmv(y, x, s.ops(pool, h_out, ws), s.row_slot)
    if name == "loop":
        def loop():
            for i, lo, hi in s.bounds:
                y[lo:hi].addmm_(x[lo:hi] @ s.a_stack[i], s.b_stack[i], alpha=0.5)
        return loop
    if name == "gather":
        def gather():
            v = torch.bmm(x.unsqueeze(1), s.a_stack[s.row_adapter])
            y.add_(torch.bmm(v, s.b_stack[s.row_adapter]).squeeze(1), alpha=0.5)
        return gather
    raise ValueError(name)


def _forced_path(decode: bool, y, x, ops, seg, row_slot) -> None:
    """add_lora_slices on the decode kernels (split-K + CUDA-core expand) or the prefill kernels
    (128-row tensor-core tiles), whatever the launcher's path choice would take."""
    from loraplex.kernels.cuda import _plan  # noqa: PLC0415

    old = _plan.SMALL_BATCH_ROWS, _plan.DECODE_MAX_SEGMENT_ROW_RANKS
    _plan.SMALL_BATCH_ROWS, _plan.DECODE_MAX_SEGMENT_ROW_RANKS = (1 << 30, 0) if decode else (0, 0)
    try:
        kcuda.add_lora_slices(y, x, ops, seg, row_slot=row_slot)
    finally:
        _plan.SMALL_BATCH_ROWS, _plan.DECODE_MAX_SEGMENT_ROW_RANKS = old


def time_graph(fns, calls: int, replays: int = 15) -> float:
    """Median device microseconds per call: graph of `calls` calls cycling over fns."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fns[i % len(fns)]()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / calls)
    return statistics.median(times)


def check(pool, ws, x, y, s, h_out, name) -> float:
    y0 = torch.randn_like(y) * 0.1
    y.copy_(y0)
    method_fn("loop", pool, ws, x, y, s, h_out)()
    ref = (y.double() - y0.double())
    y.copy_(y0)
    method_fn(name, pool, ws, x, y, s, h_out)()
    return float((y.double() - y0.double() - ref).norm() / ref.norm().clamp_min(1e-12))


def io_buffers(rows: int, h_in: int, h_out: int, sets: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(x, y) pairs for the calls to cycle over beside the table sets. A prefill call's x and y
    (32 MB each at h = 4096), reused by every call, would stay partly in L2 and flatter the
    kernels: from 16 MB a call, enough pairs for twice the 60 MB L2, at most one a set. A decode
    batch's activations are hot in L2 in a real step, so smaller calls keep one pair."""
    per = rows * (h_in + h_out) * 2
    count = 1 if per < 16e6 else max(1, min(sets, math.ceil(120e6 / per)))
    return [(torch.randn(rows, h_in, device="cuda", dtype=DT), torch.randn(rows, h_out, device="cuda", dtype=DT))
            for _ in range(count)]


def run_case(h_in, h_out, rank, batch, workload, methods, gen, rank_cap: int = 0):
    rows_adapter = workload_rows(workload, batch, gen)
    n = max(rows_adapter) + 1
    set_bytes = n * rank * (h_in + h_out) * 2
    nsets = max(2, min(16, math.ceil(256e6 / set_bytes)))
    pool, sets = build(h_in, h_out, rank, rows_adapter, nsets, gen)
    io = io_buffers(batch, h_in, h_out, nsets)
    x, y = io[0]
    ws = torch.empty(1, batch, max(rank, rank_cap), device="cuda", dtype=DT)  # its R: the kernels' rank cap
    uniq = len(set(rows_adapter))
    nbytes = uniq * rank * (h_in + h_out) * 2 + batch * (h_in + 2 * h_out) * 2
    flops = 2 * batch * rank * (h_in + h_out)
    out = dict(h_in=h_in, h_out=h_out, rank=rank, rank_cap=ws.shape[2], batch=batch, workload=workload, adapters=uniq,
               roofline_us=max(nbytes / HBM_BPS, flops / TC_FLOPS) * 1e6, bytes=nbytes, flops=flops)
    for m in methods:
        if m in ("sgmv", "sgmv_seg", "bgmv", "sgmv_dec"):
            err = check(pool, ws, x, y, sets[0], h_out, m)
            if not err < 2e-2:
                raise AssertionError(f"{m} wrong vs loop: rel err {err} at {out}")
            out[f"{m}_err"] = err
        calls = 4 if m == "loop" and len(sets[0].bounds) > 32 else 2 * nsets
        fns = [method_fn(m, pool, ws, *io[i % len(io)], s, h_out) for i, s in enumerate(sets)]
        out[f"{m}_us"] = time_graph(fns, calls)
    del pool, sets
    return out


def breakdown(gen) -> None:
    """Per-kernel device time: an empty CuPy kernel, then shrink alone / expand alone."""
    import cupy  # noqa: PLC0415

    from loraplex.kernels.checks import check_args  # noqa: PLC0415
    from loraplex.kernels.cuda._launch import Call, launch, plan_call  # noqa: PLC0415

    rt = kcuda.default_cache().get(torch.device("cuda", torch.cuda.current_device()))
    nop = cupy.RawKernel('extern "C" __global__ void nop(int* p) { if (p) *p = 0; }', "nop")

    def empty():
        with rt.launching():
            nop((1,), (32,), (0,))

    print(f"# empty CuPy kernel in a graph: {time_graph([empty], 64):.2f} us", flush=True)
    engine_b32 = [(h_in, h_out, 16, 32, w) for h_in, h_out in ((4096, 12288), (4096, 22016), (11008, 4096))
                  for w in ("distinct", "identical")]  # the 7B decode step's q/k/v, gate/up and down widths
    for h_in, h_out, r, b, w in ((4096, 4096, 16, 1, "distinct"), (4096, 4096, 16, 64, "distinct"),
                                 (4096, 4096, 16, 64, "identical"), *engine_b32, (4096, 4096, 64, 32, "distinct"),
                                 (4096, 4096, 16, 4096, "prefill4096"), (4096, 4096, 128, 4096, "prefill1024")):
        rows_adapter = workload_rows(w, b, gen)
        pool, sets = build(h_in, h_out, r, rows_adapter, 4, gen)
        x = torch.randn(b, h_in, device="cuda", dtype=DT)
        y = torch.randn(b, h_out, device="cuda", dtype=DT)
        ws = torch.empty(1, b, r, device="cuda", dtype=DT)
        line = []
        for only in (None, "shrink", "expand"):
            fns = []
            for s in sets:
                c = Call(y, x, s.ops(pool, h_out, ws), s.seg)
                prob = check_args(y, x, c.ops)
                plan = plan_call(rt, prob, 0, prob.nslots, DT)
                fns.append(lambda c=c, prob=prob, plan=plan, only=only: launch(rt, plan, prob, c, only))
            line.append(f"{only or 'both'}={time_graph(fns, 16):.1f}")
        print(f"# breakdown {h_in}x{h_out} r{r} B{b} {w}: {' '.join(line)} plan={plan}", flush=True)


def cases(quick: bool, batches: list[int] | None = None, workloads_only: bool = False, path_sweep: bool = False):
    from loraplex.kernels.cuda import _plan  # noqa: PLC0415

    if path_sweep:  # where the prefill kernels overtake the decode ones: segments of L rows, 2048 in all
        for h_in, h_out in ((4096, 4096), (11008, 4096)):
            for r in (16, 64):
                for seglen in (4, 8, 16, 24, 32, 64):
                    yield h_in, h_out, r, 2048, f"prefill{seglen}", ("sgmv", "sgmv_pre", "sgmv_dec")
        return
    batches = batches or ([1, 4, 16, 64, 256] if quick else [1, 2, 4, 8, 16, 32, 64, 128, 256])
    allm = ("sgmv", "sgmv_seg", "bgmv", "loop", "gather")
    for b in batches:
        # past 256 rows, also a full batch of 256 decodes beside a prompt chunk: the engine's steps there
        for w in WORKLOADS + (("mixed256",) if b > 256 else ()):
            # past the graphs' rows (eager steps): SGMV takes the prefill or the decode kernels by its
            # segments' mean length; set against the same call on each
            past = ("sgmv", "sgmv_pre", "sgmv_dec", "bgmv")
            yield 4096, 4096, 16, b, w, allm if b <= _plan.SMALL_BATCH_ROWS else past
    if workloads_only:
        return
    for r in (8, 32, 64):
        for b in (1, 16, 64, 256):
            for w in ("distinct", "identical"):
                yield 4096, 4096, r, b, w, allm
    for h_in, h_out in ((4096, 11008), (11008, 4096)):
        for r in (8, 16, 32, 64):
            for b in (1, 16, 64, 256):
                yield h_in, h_out, r, b, "distinct", ("sgmv", "bgmv", "gather")
    for h_in, h_out in ((4096, 4096), (4096, 11008)):
        for r in (16, 64, 128):
            for seglen in (512, 4096) if quick else (512, 1024, 2048, 4096):
                yield h_in, h_out, r, 4096, f"prefill{seglen}", ("sgmv", "sgmv_dec", "loop")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--prefill-only", action="store_true")
    ap.add_argument("--breakdown-only", action="store_true")
    ap.add_argument("--rank-cap", type=int, default=0,
                    help="workspace rank (the engine's rank cap) when above the case's rank; default: the rank")
    ap.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=None,
                    help="comma-separated batch sizes of the rank-16 four-workload grid")
    ap.add_argument("--workloads-only", action="store_true", help="only the rank-16 four-workload grid")
    ap.add_argument("--path-sweep", action="store_true",
                    help="only SGMV on both paths over segments of 4-64 rows "
                         "(the launcher's DECODE_MAX_SEGMENT_ROW_RANKS)")
    ap.add_argument("--one-row-items", type=int, default=None,
                    help="decode SGMV calls of up to this many rows take one-row items (default: the launcher's)")
    ap.add_argument("--lora-decode-rows", type=int, default=None,
                    help="SGMV calls of up to this many rows take the decode kernels (default: the launcher's "
                         "SMALL_BATCH_ROWS); the grid's batches past it time SGMV on both paths")
    args = ap.parse_args()
    if args.lora_decode_rows is not None:
        from loraplex.kernels.cuda import _plan  # noqa: PLC0415

        _plan.SMALL_BATCH_ROWS = args.lora_decode_rows
        print(f"# SMALL_BATCH_ROWS = {args.lora_decode_rows}", flush=True)
    if args.one_row_items is not None:
        from loraplex.kernels.cuda import _plan  # noqa: PLC0415

        _plan.ONE_ROW_ITEMS_ROWS = args.one_row_items
        print(f"# ONE_ROW_ITEMS_ROWS = {args.one_row_items}", flush=True)
    gen = torch.Generator().manual_seed(0)
    bw = measure_copy_bandwidth()
    print(f"# {torch.cuda.get_device_name()} copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    if not (args.workloads_only or args.path_sweep):
        breakdown(gen)
    if args.breakdown_only:
        return
    results = []
    for h_in, h_out, r, b, w, methods in cases(args.quick, args.batches, args.workloads_only, args.path_sweep):
        if args.prefill_only and not w.startswith("prefill"):
            continue
        res = run_case(h_in, h_out, r, b, w, methods, gen, args.rank_cap)
        results.append(res)
        cols = " ".join(f"{m}={res[m + '_us']:.1f}" for m in methods)
        cap = f" cap{res['rank_cap']}" if res["rank_cap"] != r else ""
        print(f"{h_in}x{h_out} r{r}{cap} B{b} {w}: roof={res['roofline_us']:.1f} {cols}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(copy_bps=bw, results=results), indent=1))


if __name__ == "__main__":
    main()
