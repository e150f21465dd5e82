"""Processes that run every step beside this one (tensor parallelism's worker ranks,
inference_server/parallel/peers.py): the runner tells them each step's plan before its own
forward. A runner with peers runs every step eager and computes no prompt log-probabilities
(the workers make logits for the sampled rows only)."""

from __future__ import annotations

from typing import Protocol

from loraplex.inference_server.engine.step_plan import StepPlan


class StepPeers(Protocol):
    why_eager: str  # why a runner with these peers captures no CUDA graphs (named by --launch-ahead on)

    def send(self, plan: StepPlan) -> None:
        """Hand the step's plan (and anything queued for it) to every peer."""
        ...

    def close(self) -> None:
        """Stop the peers."""
        ...
