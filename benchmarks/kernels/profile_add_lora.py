"""A few add_lora calls for Nsight Compute (one eager call per shape after a warm-up).

    ncu --clock-control none -k regex:lora_ --launch-skip 6 python3 -m benchmarks.kernels.profile_add_lora
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.kernels import bench_add_lora as bk

SHAPES = ((4096, 4096, 16, 1, "distinct"), (4096, 4096, 16, 64, "distinct"), (4096, 4096, 16, 4096, "prefill4096"),
          (4096, 4096, 16, 32, "distinct"), (4096, 22016, 16, 32, "distinct"))  # the last two: 7B decode, o and gate/up


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # no options: --help only
    gen = torch.Generator().manual_seed(0)
    calls = []
    for h_in, h_out, r, b, w in SHAPES:
        pool, sets = bk.build(h_in, h_out, r, bk.workload_rows(w, b, gen), 2, gen)
        x = torch.randn(b, h_in, device="cuda", dtype=bk.DT)
        y = torch.randn(b, h_out, device="cuda", dtype=bk.DT)
        ws = torch.empty(1, b, r, device="cuda", dtype=bk.DT)
        calls.append(bk.method_fn("sgmv", pool, ws, x, y, sets[0], h_out))
        calls[-1]()  # warm-up: compile and allocate (skipped by --launch-skip)
    torch.cuda.synchronize()
    for fn in calls:
        fn()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
