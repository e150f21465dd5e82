"""Host-to-pool copies: on CUDA an async copy on a side stream that completes on an event,
so decode steps on the compute stream keep running; on the CPU a plain copy."""

from __future__ import annotations

import torch


class PoolCopier:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @property
    def wants_pinned(self) -> bool:
        """Whether host buffers should be pinned (copies are asynchronous)."""
        return self._stream is not None

    def prepare(self, flat: torch.Tensor) -> torch.Tensor:
        """Host staging form of a packed adapter: pinned when copies are asynchronous."""
        return flat.pin_memory() if self.wants_pinned and not flat.is_pinned() else flat

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst (a pool slice) <- src (host). Blocks the calling loader thread until the bytes
        have landed; never touches the compute stream."""
        if self._stream is None:
            dst.copy_(src)
            return
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        done.synchronize()
