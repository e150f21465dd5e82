"""LoRA layers: wrap the model's base linears so each adds the step's adapter deltas.

The model stays plain nn.Modules; ``attach_lora`` replaces its fused projections with
``LoraLinear`` from outside. All wrappers share one ``LoraContext``, owned by the model
runner, whose ``batch`` it sets before each forward (None = no adapter in this step).
"""

from __future__ import annotations

import torch
from torch import nn

from loraplex import kernels
from loraplex.inference_server.lora.batch import LoraBatch, ProjGroup


class LoraContext:
    """The runner's handle on the current step's LoRA metadata (passed, not global)."""

    def __init__(self) -> None:
        self.batch: LoraBatch | None = None


class LoraLinear(nn.Module):
    """y = base(x), then y += the LoRA delta of each row's adapter (all slices in one call)."""

    def __init__(self, base: nn.Linear, layer: int, group: ProjGroup, ctx: LoraContext) -> None:
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


_TARGETS = {
    "self_attn.qkv_proj": ProjGroup.QKV,
    "self_attn.o_proj": ProjGroup.O,
    "mlp.gate_up_proj": ProjGroup.GATE_UP,
    "mlp.down_proj": ProjGroup.DOWN,
}


def attach_lora(model: nn.Module, ctx: LoraContext) -> None:
    """Wrap every decoder layer's projections of ``model`` (a Llama-family module tree)."""
    for index, layer in enumerate(model.layers):
        for path, group in _TARGETS.items():
            parent_name, child = path.split(".")
            parent = getattr(layer, parent_name)
            base = getattr(parent, child)
            if not isinstance(base, LoraLinear):
                setattr(parent, child, LoraLinear(base, index, group, ctx))
