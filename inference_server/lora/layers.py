"""LoRA layers: wrap the model's base linears so each adds the step's adapter deltas.

The model stays plain nn.Modules; ``attach_lora`` replaces the projections its ``lora_sites``
names (each with its layer and ``Slot``: the role, not a module path) with ``LoraLinear`` from
outside. All wrappers share one ``LoraContext``, owned by the model runner, whose ``batch`` it
sets before each forward (None = no adapter in this step).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from loraplex import kernels
from loraplex.adapter_store.format.architectures import Slot
from loraplex.inference_server.lora.batch import LoraBatch
from loraplex.inference_server.model.layers import LoraSite


class LoraContext:
    """The runner's handle on the current step's LoRA metadata (passed, not global)."""

    def __init__(self) -> None:
        self.batch: LoraBatch | None = None


class LoraLinear(nn.Module):
    """y = base(x), then y += the LoRA delta of each row's adapter (all slices in one call)."""

    def __init__(self, base: nn.Linear, layer: int, group: Slot, ctx: LoraContext) -> None:
        super().__init__()
        self.base = base
        self.layer = layer
        self.group = group
        self.ctx = ctx

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = self.ctx.batch
        if batch is None:
            return self._base(x)
        return batch.apply(x, self.layer, self.group, self._base)

    def _base(self, x: torch.Tensor) -> torch.Tensor:
        base = self.base
        return kernels.linear(x, base.weight, base.bias) if type(base) is nn.Linear else base(x)


def wrap_sites(sites: Iterable[LoraSite], ctx: LoraContext,
               wrapper: Callable[[nn.Module], type[LoraLinear]] = lambda base: LoraLinear) -> None:
    """Replace each site's base projection with its LoRA wrapper (``wrapper(base)`` picks the
    class; sites already wrapped are left as they are)."""
    for site in sites:
        base = getattr(site.owner, site.attr)
        if not isinstance(base, LoraLinear):
            setattr(site.owner, site.attr, wrapper(base)(base, site.layer, site.slot, ctx))


def attach_lora(model: nn.Module, ctx: LoraContext) -> None:
    """Wrap every projection ``model.lora_sites()`` names (a DecoderLM of any family)."""
    wrap_sites(model.lora_sites(), ctx)
