"""The tensor-parallel process group and the collectives the sharded model uses.

Two groups over the same ranks: the *device* group (NCCL when the tensors live on CUDA, gloo
on the CPU) carries activations (all-reduce, logits gather); the *control* group (always
gloo, CPU) carries pickled step metadata and adapter shards. The control group has a very
long timeout because a worker waits on it for the next step however long the server is idle;
a dead peer is still noticed at once (gloo fails on the closed connection) and workers also
exit when their parent dies. With world size 1 there is no process group at all and every
collective is the identity, so one process runs exactly the unsharded arithmetic.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

CONTROL_TIMEOUT = datetime.timedelta(days=365)


def rank_device(device: str, rank: int) -> str:
    """The device of ``rank``: ``cpu`` for every rank, else ``cuda:<base + rank>``."""
    if device == "cpu":
        return "cpu"
    if not device.startswith("cuda"):
        raise ValueError(f"tensor parallelism runs on cpu or cuda devices, not {device!r}")
    base = int(device.split(":", 1)[1]) if ":" in device else 0
    return f"cuda:{base + rank}"


def backend_for(device: str) -> str:
    """NCCL for CUDA tensors, gloo for CPU tensors: the same code path either way."""
    return "nccl" if device.startswith("cuda") else "gloo"


@dataclass(eq=False)
class TPGroup:
    """This process's place in the tensor-parallel group and its collectives."""

    rank: int
    world_size: int
    device: str
    device_group: Any = None  # torch ProcessGroup, None when world_size == 1
    control_group: Any = None

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in a tensor-parallel group of {self.world_size}")
        if self.world_size > 1 and (self.device_group is None or self.control_group is None):
            raise ValueError("a tensor-parallel group of more than one rank needs its process groups")

    @classmethod
    def single(cls, device: str) -> "TPGroup":
        """World size 1: no processes to talk to, every collective is the identity."""
        return cls(0, 1, device)

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """In place: t = sum of t over the ranks. Returns t."""
        if self.world_size > 1:
            dist.all_reduce(t, group=self.device_group)
        return t

    def gather_last_dim(self, t: torch.Tensor) -> torch.Tensor | None:
        """Rank 0 gets the ranks' [.., n] pieces concatenated to [.., world*n]; others None."""
        if self.world_size == 1:
            return t
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.world_size)] if self.is_first else None
        dist.gather(t, parts, dst=0, group=self.device_group)
        return torch.cat(parts, dim=-1) if self.is_first else None

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0 sends ``obj`` (pickled) to every rank; every rank returns it."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control_group)
        return box[0]

    def scatter_bytes(self, out: torch.Tensor, chunks: list[torch.Tensor] | None = None) -> torch.Tensor:
        """Rank r receives ``chunks[r]`` (given on rank 0; equal sizes, CPU) into ``out``."""
        if self.world_size == 1:
            out.copy_(chunks[0])
            return out
        as_bytes = [c.contiguous().view(torch.uint8) for c in chunks] if chunks is not None else None
        dist.scatter(out.view(torch.uint8), as_bytes, src=0, group=self.control_group)
        return out

    def min_int(self, value: int) -> int:
        """The smallest of the ranks' ``value`` (every rank gets it)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.control_group)
        return int(t.item())


def join_group(rank: int, world_size: int, device: str, store: Any, timeout_s: float) -> TPGroup:
    """Join the default process group through ``store`` (a TCPStore on rank 0) and make the
    control group. ``timeout_s`` bounds collectives inside a step (device group)."""
    backend = backend_for(device)
    if backend == "nccl":
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
    )
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    return TPGroup(rank, world_size, device, dist.group.WORLD, control)


def leave_group() -> None:
    """Destroy this process's process groups (if any)."""
    if dist.is_initialized():
        dist.destroy_process_group()
