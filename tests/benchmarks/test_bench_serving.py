"""bench_grpc_vs_inprocess.py (the serving edge's benchmark): a round of gRPC streams against a real server
process over the synthetic engine, and the per-token delivery figures of merged messages."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest

from benchmarks.serving import bench_grpc_vs_inprocess


def test_delivery_counts_every_token_of_a_merged_message() -> None:
    # (send), then (arrival, tokens, text): the synthetic engine stamps each token's step time
    streams = [[(0.0, 0, ""), (1.010, 1, "1.000 "), (1.025, 3, "1.005 1.010 1.020 ")]]
    delivery = sorted(bench_grpc_vs_inprocess.delivery_ms(streams))
    assert delivery == pytest.approx([5.0, 10.0, 15.0, 20.0])
    assert bench_grpc_vs_inprocess.delivery_ms([[(0.0, 0, ""), (1.0, 1, "real text")]]) == []


def test_a_round_over_grpc_streams_every_token(tmp_path: Path) -> None:
    args = argparse.Namespace(engine="synthetic", step_ms=1.0, streams=[4], new_tokens=16, client_procs=2)
    server = bench_grpc_vs_inprocess.start_server(args, tmp_path)
    try:
        results = bench_grpc_vs_inprocess.run_rounds_over_grpc(args, server.grpc_address, ["a0", "a1"])
    finally:
        server.stop()
    first, four = results[1], results[4]
    assert first["tokens"] == 16 and four["tokens"] == 4 * 16
    assert not math.isnan(four["delivery_p50_ms"]) and four["delivery_p50_ms"] >= 0.0
    assert four["tok_s"] > 0 and four["itl_p50_ms"] > 0.0


def test_a_server_that_dies_at_start_fails_the_run_at_once(tmp_path: Path) -> None:
    args = argparse.Namespace(engine="synthetic", step_ms=-1.0)  # the server refuses a negative step
    with pytest.raises(RuntimeError, match="exited"):
        bench_grpc_vs_inprocess.start_server(args, tmp_path)
