"""Prefill add_lora, shrink alone and expand alone (T = 4096 rows, h_in = 4096) for settings of
the launcher's prefill split (PREFILL_MAX_BLOCKS_PER_SM: the shrink's split-K blocks a
multiprocessor), each checked against the Loop baseline before it is timed.

    python3 -m benchmarks.kernels.bench_prefill_tunables [BLOCKS ...]

With no BLOCKS, the launcher's own. Prints one line per case and setting: device microseconds
(CUDA-graph replays, bench_add_lora.time_graph) and the share of the bandwidth roofline (bytes /
4.23 TB/s). To time another version's kernels with this script (two versions in one lease), run it
from this checkout's root with ``PYTHONPATH=<that tree>``: the benchmarks package puts this
checkout's root last on ``sys.path``, so ``loraplex`` comes from that tree."""
import argparse
import math

import torch

from benchmarks.kernels import bench_add_lora as bk
from loraplex.kernels import cuda as kcuda
from loraplex.kernels.checks import check_args
from loraplex.kernels.cuda import _launch

# (h_out, rank, segments, rank cap: the workspace's R, which picks the kernel variant; the server's
# default cap is 128, so its rank-16 prefills run the r128 variants)
CASES = [(4096, 16, "prefill4096", 16), (4096, 16, "prefill512", 16), (4096, 16, "prefill4096", 128),
         (4096, 64, "prefill4096", 64), (4096, 128, "prefill4096", 128), (4096, 128, "prefill1024", 128),
         (11008, 16, "prefill4096", 16), (11008, 128, "prefill4096", 128)]


def io_pairs(h_out: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(x, y) copies for the calls to cycle over: twice the 60 MB L2 in all, at most `count`
    (as bench_add_lora.io_buffers, kept here so that the script also runs over older trees)."""
    n = max(1, min(count, math.ceil(120e6 / (4096 * (4096 + h_out) * 2))))
    return [(torch.randn(4096, 4096, device="cuda", dtype=bk.DT), torch.randn(4096, h_out, device="cuda", dtype=bk.DT))
            for _ in range(n)]


def timed(rt, pool, sets, io, ws, h_out):
    out = []
    for only in (None, "shrink", "expand"):
        fns = []
        for i, s in enumerate(sets):
            x, y = io[i % len(io)]
            c = _launch.Call(y, x, s.ops(pool, h_out, ws), s.seg)
            prob = check_args(y, x, c.ops)
            plan = _launch.plan_call(rt, prob, 0, prob.nslots, bk.DT)
            fns.append(lambda c=c, prob=prob, plan=plan, only=only: _launch.launch(rt, plan, prob, c, only))
        out.append(bk.time_graph(fns, 16))
    return out, plan


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("blocks", nargs="*",
                        help="PREFILL_MAX_BLOCKS_PER_SM settings to time (none: the launcher's own)")
    configs = parser.parse_args().blocks or ["default"]  # "default": the launcher's settings as they are
    rt = kcuda.default_cache().get(torch.device("cuda", 0))
    gen = torch.Generator().manual_seed(0)
    for h_out, rank, w, cap in CASES:
        pool, sets = bk.build(4096, h_out, rank, bk.workload_rows(w, 4096, gen), 4, gen)
        io = io_pairs(h_out, len(sets))
        x, y = io[0]
        ws = torch.empty(1, 4096, cap, device="cuda", dtype=bk.DT)
        nbytes = rank * (4096 + h_out) * 2 * len(sets[0].bounds) + 4096 * (4096 + 2 * h_out) * 2
        roof = nbytes / bk.HBM_BPS * 1e6
        for cfg in configs:
            if cfg != "default":
                _launch.PREFILL_MAX_BLOCKS_PER_SM = int(cfg)
            err = bk.check(pool, ws, x, y, sets[0], h_out, "sgmv")
            assert err < 2e-2, (cfg, h_out, rank, cap, w, err)
            (both, sh, ex), plan = timed(rt, pool, sets, io, ws, h_out)
            print(f"4096x{h_out} r{rank} cap{cap} {w} [{cfg}]: add_lora {both:.1f} us ({roof / both:.0%} of {roof:.1f}) "
                  f"shrink {sh:.1f} expand {ex:.1f} ksplit={plan.ksplit} err={err:.1e}", flush=True)
        del pool, sets, io, x, y, ws
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
