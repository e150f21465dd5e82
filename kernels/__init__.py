"""LoRA kernels, one device-agnostic entry point.

16-bit CUDA tensors (bfloat16, float16) go to the SGMV/BGMV CUDA kernels (compiled at run
time through CuPy/NVRTC, see ``loraplex.kernels.cuda``); float32/float64 CPU tensors to the CPU
backend (``loraplex.kernels.cpu``, bitwise the reference with less overhead). Everything else goes
to the PyTorch reference (``loraplex.kernels.reference``), which defines the semantics: 16-bit CPU
tensors, and float32 / float64 CUDA tensors, the exactness mode used to check the GPU engine
against the CPU one (the reference syncs with the host, so that mode is not CUDA-graph
capturable). Callers never choose the backend. Every backend takes the same operands
(``loraplex.kernels.operands.LoraOperands``) beside y, x and the row layout.

``linear`` (``loraplex.kernels.dense``) is the base projections' y = x W^T + b, in the form MKL runs
fastest for a decode batch's few rows on the CPU.

``loraplex.kernels.paged_decode`` is the same kind of entry point for decode attention over the paged
KV cache: a workspace where the CUDA kernel applies, None where the caller's portable path runs.
"""

from __future__ import annotations

import torch

from loraplex.kernels import checks, cpu, reference
from loraplex.kernels.dense import linear
from loraplex.kernels.operands import LoraOperands

__all__ = ["LoraOperands", "add_lora_slices", "add_lora_slices_bgmv", "can_stage", "linear", "prepare", "reference",
           "step_cache"]


_KERNEL_DTYPES = (torch.bfloat16, torch.float16)


def _use_cuda(x: torch.Tensor) -> bool:
    return x.is_cuda and x.dtype in _KERNEL_DTYPES


def _cuda_ops():
    from loraplex.kernels import cuda  # noqa: PLC0415  (imports CuPy; only on CUDA tensors)

    return cuda


def add_lora_slices(y: torch.Tensor, x: torch.Tensor, ops: LoraOperands, seg: torch.Tensor, *,
                    cache: object | None = None, stage: str = "both", row_slot: torch.Tensor | None = None) -> None:
    """SGMV: y[:, slice p][seg_i] += scale_pi * (x[seg_i] @ A_pi) @ B_pi. See reference.add_lora_slices.

    ``cache``: what ``step_cache(pool)`` returned for this pool (kept by the caller across
    steps), or None. ``stage``: "both"; or, where ``can_stage(x)``, "shrink" then "expand"
    (two calls, same arguments; see ``loraplex.kernels.cuda.add_lora_slices``). ``row_slot``: the
    same layout as ``seg`` row by row, which the CUDA decode expand may use instead (same
    result); the other backends do not need it."""
    if _use_cuda(x):
        _cuda_ops().add_lora_slices(y, x, ops, seg, stage, row_slot)
        return
    if stage != "both":
        raise ValueError(f"stage {stage!r} needs the CUDA kernels (16-bit CUDA tensors), got {x.dtype} on {x.device}")
    checks.check_seg(seg, checks.check_args(y, x, ops), x.device)
    if not x.is_cuda and x.dtype in cpu.FAST_DTYPES:
        cpu.add_lora_slices(y, x, ops, seg, cache)
    else:
        reference.add_lora_slices(y, x, ops, seg)


def prepare(pool: torch.Tensor) -> None:
    """Make the kernels that serve ``pool``'s device and dtype ready now (compiled, on CUDA), so no
    step pays for it: a server calls it at start. Nothing to do for the other backends."""
    if _use_cuda(pool):
        _cuda_ops().compile_kernels(pool.device)


def can_stage(x: torch.Tensor) -> bool:
    """Whether add_lora_slices on x can run as separate shrink and expand calls."""
    return _use_cuda(x)


def step_cache(pool: torch.Tensor) -> cpu.DecodeStacks | None:
    """A cache the backend of ``pool`` keeps across steps (pass it to ``add_lora_slices``), or
    None when it needs none. The CPU backend keeps a decode batch's stacked adapters
    (``cpu.DecodeStacks``): about one copy of the adapters of one batch."""
    return cpu.DecodeStacks() if not pool.is_cuda and pool.dtype in cpu.FAST_DTYPES else None


def add_lora_slices_bgmv(y: torch.Tensor, x: torch.Tensor, ops: LoraOperands, row_slot: torch.Tensor) -> None:
    """BGMV: y[t, slice p] += scale_ps * (x[t] @ A_ps) @ B_ps, s = row_slot[t]. See the reference."""
    if _use_cuda(x):
        _cuda_ops().add_lora_slices_bgmv(y, x, ops, row_slot)
        return
    checks.check_row_slot(row_slot, checks.check_args(y, x, ops), x.device)
    reference.add_lora_slices_bgmv(y, x, ops, row_slot)
