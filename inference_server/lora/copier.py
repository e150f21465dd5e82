"""Host-to-pool copies: on CUDA an async copy on a side stream that completes on an event,
so decode steps on the compute stream keep running; on the CPU a plain copy.

``unpack`` also runs the device half of ``device_packing`` (gather, transposes, casts) on
the same side stream, after the one copy of the staged bytes and before the event."""

from __future__ import annotations

import torch

from inference_server.lora import device_packing
from inference_server.lora.device_packing import DevicePackPlan
from inference_server.lora.packing import AdapterLayout


class PoolCopier:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

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
            device_packing.unpack(dst, staged, plan, layout)
            return
        with torch.cuda.stream(self._stream):
            on_device = torch.empty(staged.shape, dtype=staged.dtype, device=self.device)
            on_device.copy_(staged, non_blocking=True)
            device_packing.unpack(dst, on_device, plan, layout)
            done = torch.cuda.Event()
            done.record(self._stream)
        done.synchronize()
