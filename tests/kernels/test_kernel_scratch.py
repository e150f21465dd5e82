"""The LoRA kernels' scratch never frees what it handed out (kernels/cuda/_scratch.GrowOnly):
captured CUDA graphs keep raw pointers into it, so an outgrown buffer must stay allocated."""

from __future__ import annotations

import gc
import weakref

import torch

from loraplex.kernels.cuda._scratch import GrowOnly


def test_outgrown_buffers_stay_alive_and_new_ones_are_zero():
    buf = GrowOnly(torch.int32, torch.device("cpu"), minimum=16)
    first = buf.at_least(10)
    assert first.numel() == 16 and not first.any()
    first.fill_(5)  # as a launch leaves it
    assert buf.at_least(16) is first  # fits: the same buffer, contents kept
    alive = weakref.ref(first)
    del first
    second = buf.at_least(17)
    gc.collect()
    assert alive() is not None and alive() is buf.retired[0]  # still allocated: a graph may point at it
    assert second.numel() == 32 and not second.any()  # grows 2x at least, zeroed
    third = buf.at_least(1000)
    assert third.numel() == 1000 and [t.numel() for t in buf.retired] == [16, 32]
    assert sum(t.numel() for t in buf.retired) < third.numel()
