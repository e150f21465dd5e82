"""SGMV / BGMV LoRA kernels for CUDA tensors (CUDA C++ under kernels/csrc, NVRTC via CuPy).

Same operands and semantics as ``loraplex.kernels.reference.add_lora_slices`` /
``add_lora_slices_bgmv``. Launches go on PyTorch's current stream, allocate nothing per
call (scratch is static per device, see ``_runtime``) and depend only on tensor shapes,
so they can be captured in a CUDA graph and replayed after rewriting the tables.
"""

from __future__ import annotations

import torch

from loraplex.kernels.checks import check_args, check_row_slot, check_seg
from loraplex.kernels.cuda._checks import check_cuda
from loraplex.kernels.cuda._launch import Call, launch, plan_call
from loraplex.kernels.cuda._runtime import RuntimeCache, default_cache
from loraplex.kernels.operands import LoraOperands

__all__ = ["STAGES", "add_lora_slices", "add_lora_slices_bgmv", "compile_kernels", "RuntimeCache", "default_cache"]

STAGES = ("both", "shrink", "expand")


def compile_kernels(device: torch.device) -> None:
    """Compile every LoRA kernel module for ``device`` now rather than at its first call (the
    prefill modules take ~8 s on an H100 unless CuPy's kernel cache on disk holds them)."""
    default_cache().get(device).compile_all()


def add_lora_slices(y: torch.Tensor, x: torch.Tensor, ops: LoraOperands, seg: torch.Tensor, stage: str = "both",
                    row_slot: torch.Tensor | None = None) -> None:
    """SGMV: y[seg_i, c_p:c_p+w_p] += scales[p,i] * (x[seg_i] @ A_pi(layer)) @ B_pi(layer)

    y: [T, sum(out_widths)] bf16/fp16, rows contiguous (row stride free); x: [T, h_in],
    same dtype, last dim contiguous (row stride free); ``ops`` as ``loraplex.kernels.operands`` says
    (ranks at most min(R, 128)); seg: int32 [S+1] (non-decreasing, trailing empty segments
    allowed; S at most the tables' columns, and the grids are sized by it). The workspace is
    scratch: the prefill path stores x @ A rounded to x's dtype there; the decode path (T <= 512,
    or short segments for their rank) keeps it in the runtime's own fp32 scratch and rounds it
    the same way; contents after the call are unspecified. One call at a time per device: the runtime's scratch is
    shared.
    stage: "both", or "shrink" then "expand" as two calls with the same arguments, so a
    caller can run the shrink (which reads x only) beside other work, e.g. on a side stream
    next to the base projection that produces y; nothing else may use the kernels between
    the two. row_slot: optional int32 [T], the same layout as seg (row t of segment i -> i, -1
    past seg[S]); on the decode path both kernels then read their items from it: one row per item
    for calls of up to ONE_ROW_ITEMS_ROWS rows (which without it find each row's segment
    themselves), row_slot's runs in 4-row tiles past it; bitwise the same result. Raises ValueError on
    a dtype, device, shape or stride mismatch.
    """
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    check_cuda(x)
    problem = check_args(y, x, ops)
    check_seg(seg, problem, x.device)
    if row_slot is not None:
        check_row_slot(row_slot, problem, x.device)
    if problem.rows == 0 or seg.shape[0] == 1:  # no rows, or no segments
        return
    rt = default_cache().get(x.device)
    plan = plan_call(rt, problem, 0, seg.shape[0] - 1, x.dtype)
    call = Call(y, x, ops, seg, row_slot)
    launch(rt, plan, problem, call, None if stage == "both" else stage)


def add_lora_slices_bgmv(y: torch.Tensor, x: torch.Tensor, ops: LoraOperands, row_slot: torch.Tensor) -> None:
    """BGMV: y[t, c_p:c_p+w_p] += scales[p,s] * (x[t] @ A_ps(layer)) @ B_ps(layer), s = row_slot[t]

    As add_lora_slices, with row_slot: int32 [T] (-1 = no adapter for that row) instead of
    seg; the tables are [P, N_slots] and indexed by slot.
    """
    check_cuda(x)
    problem = check_args(y, x, ops)
    check_row_slot(row_slot, problem, x.device)
    if problem.rows == 0:
        return
    rt = default_cache().get(x.device)
    plan = plan_call(rt, problem, 1, problem.rows, x.dtype)
    launch(rt, plan, problem, Call(y, x, ops, row_slot))
