"""Host-to-pool copies: on CUDA an async copy on a side stream that completes on an event,
so decode steps on the compute stream keep running; on the CPU a plain copy.

``unpack`` also runs the device half of ``device_packing`` (gather, transposes, casts) on
the same side stream, after the one copy of the staged bytes and before the event. Its two
device buffers (the staged bytes, the gathered tensors) are kept and grown across loads;
loads enqueue one at a time, and on CUDA the side stream orders one load's reads of the
buffers before the next load's writes, so only the enqueueing is serialised."""

from __future__ import annotations

import threading

import torch

from loraplex.inference_server.lora.pool import device_packing
from loraplex.inference_server.lora.pool.device_packing import DevicePackPlan
from loraplex.inference_server.lora.resident import AdapterLayout

_GROW_BYTES = 16 << 20  # buffers grow in steps of this


class PoolCopier:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._lock = threading.Lock()
        self._staged = torch.empty(0, dtype=torch.uint8, device=device)
        self._gathered = torch.empty(0, dtype=torch.uint8, device=device)

    @property
    def wants_pinned(self) -> bool:
        """Whether host buffers should be pinned (copies are asynchronous)."""
        return self._stream is not None

    def prepare(self, flat: torch.Tensor) -> torch.Tensor:
        """Host staging form of a tensor: pinned when copies are asynchronous."""
        return flat.pin_memory() if self.wants_pinned and not flat.is_pinned() else flat

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """dst (a pool slice) <- src (host, already in the pool layout). Blocks the calling
        loader thread until the bytes have landed; never touches the compute stream."""
        if self._stream is None:
            dst.copy_(src)
            return
        with torch.cuda.stream(self._stream):
            dst.copy_(src, non_blocking=True)
            done = torch.cuda.Event()
            done.record(self._stream)
        done.synchronize()

    def unpack(self, dst: torch.Tensor, staged: torch.Tensor, plan: DevicePackPlan, layout: AdapterLayout) -> None:
        """dst (a pool slice) <- the pool layout of ``staged`` (host bytes from
        ``device_packing.stage``): one copy to the device, then the layout change there.
        Blocks the calling loader thread until done; never touches the compute stream. On the
        CPU the layout change reads ``staged`` in place."""
        if self._stream is None:
            with self._lock:
                device_packing.unpack(dst, staged, plan, layout, self._grown("_gathered", plan.data_bytes))
            return
        with self._lock, torch.cuda.stream(self._stream):
            on_device = self._grown("_staged", staged.numel())[: staged.numel()]
            on_device.copy_(staged, non_blocking=True)
            device_packing.unpack(dst, on_device, plan, layout, self._grown("_gathered", plan.data_bytes))
            done = torch.cuda.Event()
            done.record(self._stream)
        done.synchronize()

    def _grown(self, name: str, num_bytes: int) -> torch.Tensor:
        """The kept buffer ``name``, reallocated larger when it holds fewer than ``num_bytes``
        (on CUDA inside the side stream, so the old block is reused only after its readers)."""
        buffer = getattr(self, name)
        if buffer.numel() < num_bytes:
            buffer = torch.empty(-(-num_bytes // _GROW_BYTES) * _GROW_BYTES, dtype=torch.uint8, device=self.device)
            setattr(self, name, buffer)
        return buffer
