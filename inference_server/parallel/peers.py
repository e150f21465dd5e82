"""Rank 0's peers: each step's plan and new adapter shards go to the worker ranks.

The scheduler, the block manager and the adapter bookkeeping live on rank 0 only; rank 0's
ModelRunner is the plain one, given these peers (engine/step_peers.py). Each step: plan (plain
Python) -> broadcast the plan and any adapter placements -> scatter the workers' adapter shards
-> forward on every rank -> logits gathered on rank 0 -> sample on rank 0.
"""

from __future__ import annotations

import torch

from loraplex.inference_server.engine.step_plan import StepPlan
from loraplex.inference_server.parallel.adapters import ShardLoad, TensorParallelPacking
from loraplex.inference_server.parallel.group import TPGroup, leave_group
from loraplex.inference_server.parallel.worker import StepMessage


class TensorParallelPeers:
    """The worker ranks of a tensor-parallel group, seen from rank 0 (``workers``: their
    processes, None for world size 1)."""

    why_eager = "tensor parallelism runs every step eager (no CUDA graphs, no launch-ahead)"

    def __init__(self, group: TPGroup, packing: TensorParallelPacking, workers=None) -> None:
        self.group = group
        self.packing = packing
        self.workers = workers

    def send(self, plan: StepPlan) -> None:
        if self.workers is not None:
            self.workers.check_alive()
        loads = self.packing.take_loads()
        self.group.broadcast(StepMessage(plan, [(load.start, load.numel) for load in loads]))
        for load in loads:
            self._send_shards(load)

    def _send_shards(self, load: ShardLoad) -> None:
        own = torch.empty(load.numel, dtype=load.shards.dtype)
        self.group.scatter_bytes(own, [load.shards[0], *load.shards.unbind(0)])

    def close(self) -> None:
        """Tell the workers to stop, wait for them (killing stragglers), leave the group."""
        if self.workers is None:
            return
        try:
            if self.workers.all_alive():
                self.group.broadcast(None)
        finally:
            self.workers.stop()
            leave_group()
            self.workers = None
