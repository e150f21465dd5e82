"""A step launched on the device whose sampled tokens the host has not read yet.

The engine launches step N+1 before it reads step N's tokens (LLMEngine.step), so the GPU
never waits for the host's per-step Python (token bookkeeping, detokenization, streaming,
scheduling, planning). What makes that possible: step N+1's rows that need a token of step
N (a sequence's next input) take it on the device, from N's sampled-token tensor, and
step N's sampling needs nothing from the host: greedy rows take an argmax, sampled rows draw
from their request's own generator on the device (``sampler.choose``), a repetition penalty
reads the sequence's seen tokens from a row kept on the device, to which the newest token is
added from N's sampled-token tensor (``SeenTokens``), and log-probabilities are computed there
and copied to pinned host memory with the tokens (``LaunchedLogprobs``). A constrained row's
grammar mask is filled on the host from the tokens read so far, so its step waits for its
previous token to be read (LLMEngine._launch); the mask reaches the device through pinned memory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loraplex.inference_server.engine.sampler import SampleRow, read_logprobs
from loraplex.inference_server.engine.sequence import Sequence


@dataclass(frozen=True, slots=True)
class LaunchedLogprobs:
    """``sampler.logprobs_on_device``'s figures for a launched step's sampled rows, in pinned
    host memory (copied before the step's ``ready`` event)."""

    rows: list[SampleRow]
    chosen: torch.Tensor  # float32 [n]
    values: torch.Tensor  # float32 [n, K]
    ids: torch.Tensor  # int64 [n, K]

    def read(self) -> tuple[list[float | None], list[dict[int, float] | None]]:
        return read_logprobs(self.rows, self.chosen.tolist(), self.values.tolist(), self.ids.tolist())


@dataclass(eq=False, slots=True)
class LaunchedStep:
    seqs: list[Sequence]
    num_tokens: list[int]
    sample_seqs: list[Sequence]  # one per sampled row, in row order
    tokens: torch.Tensor  # int64 [len(sample_seqs)] on the device: what the next step may read
    host: torch.Tensor  # pinned int64 [len(sample_seqs)]: the same tokens, copied when ready
    ready: torch.cuda.Event  # recorded after the copy to ``host``
    token_index: list[int] = field(default_factory=list)  # per sample seq: its placeholder's index
    logprobs: LaunchedLogprobs | None = None  # when a sampled row asked for log-probabilities

    def index_of(self) -> dict[int, int]:
        """id(seq) -> its row in ``tokens``."""
        return {id(s): i for i, s in enumerate(self.sample_seqs)}

    def token_ids(self) -> list[int]:
        """The sampled tokens (waits for the device)."""
        self.ready.synchronize()
        return self.host.tolist()
