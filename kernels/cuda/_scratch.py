"""Device scratch that only grows and never frees what it handed out (the LoRA kernels'
split-K partials and counters, kernels/cuda/_runtime.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class GrowOnly:
    """A zeroed device buffer of at least the asked size that never frees what it handed out:
    a captured CUDA graph keeps raw pointers into it, so an outgrown buffer is retired (kept
    for the life of the runtime), not returned to the allocator. It grows at least 2x, so the
    retired buffers together are smaller than the current one."""

    dtype: torch.dtype
    device: torch.device
    minimum: int
    current: torch.Tensor | None = None
    retired: list = field(default_factory=list)

    def fits(self, n: int) -> bool:
        return self.current is not None and self.current.numel() >= n

    def at_least(self, n: int) -> torch.Tensor:
        if not self.fits(n):
            old = 0
            if self.current is not None:
                old = self.current.numel()
                self.retired.append(self.current)
            self.current = torch.zeros(max(n, 2 * old, self.minimum), dtype=self.dtype, device=self.device)
        return self.current
