"""Copies into the adapter pool, each announced to listeners with the pool's write count.

A listener (the CPU decode stacks, kernels/cpu_stacks.py, which keep copies of pool ranges)
hears of every adapter copied into the pool: elements [start, end) and the pool's
``_version`` before and after that copy alone, so it can tell which of its copies went stale.
While any listener exists the copies are serialized, so each window holds one copy only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from loraplex.inference_server.lora.pool.copier import PoolCopier
from loraplex.inference_server.lora.pool.host_cache import PackedAdapter

# (pool, start, end, write count before, after)
WriteListener = Callable[[torch.Tensor, int, int, int, int], None]


class PoolWrites:
    """Writes packed adapters into ``pool`` through ``copier`` and announces each write."""

    def __init__(self, pool: torch.Tensor, copier: PoolCopier) -> None:
        self.pool = pool
        self._copier = copier
        self._listeners: list[WriteListener] = []
        self._lock = threading.Lock()

    @property
    def counted(self) -> bool:
        """Whether the pool has a write count (``_version``; not for inference-mode tensors)."""
        try:
            self.pool._version  # noqa: B018
        except RuntimeError:
            return False
        return True

    def add_listener(self, listener: WriteListener) -> None:
        """Call ``listener(pool, start, end, before, after)`` after each write (see the module)."""
        if not self.counted:
            raise ValueError("the adapter pool was made in inference mode: it has no write count to announce")
        self._listeners.append(listener)

    def write(self, start: int, packed: PackedAdapter) -> None:
        """pool[start : start + n] <- the adapter in the pool layout (blocks until it landed)."""
        end = start + packed.layout.num_elements
        dst = self.pool[start:end]
        if not self._listeners:
            self._write(dst, packed)
            return
        with self._lock:
            before = self.pool._version
            self._write(dst, packed)
            after = self.pool._version
        for listener in self._listeners:
            listener(self.pool, start, end, before, after)

    def _write(self, dst: torch.Tensor, packed: PackedAdapter) -> None:
        if packed.plan is None:  # packed on the host already
            self._copier.copy(dst, packed.flat[: packed.layout.num_elements])
        else:
            self._copier.unpack(dst, packed.flat, packed.plan, packed.layout)
