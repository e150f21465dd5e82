"""The GPU's own ceilings, measured where a benchmark runs (a roofline must come from the card in
hand: an H100's copy bandwidth is ~3.0 TB/s, an H200's ~4.2)."""

from __future__ import annotations

import statistics

import torch


def measure_copy_bandwidth() -> float:
    """Device-to-device copy bandwidth (bytes read + written) of 1 GiB copies, eager and timed with
    CUDA events (median of 10). Not in a graph: a captured copy_ runs other copy kernels than an
    eager one (pytorch/pytorch#191284), and read 2.71-2.75 TB/s on the H200 where eager copies read
    4.27 (sessions 9-10)."""
    a = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    times = []
    for _ in range(10):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return 2 * a.numel() * 4 / statistics.median(times)
