"""What an adapter must fit: the base model's family (architectures.py: which projections PEFT
may target and how they are named), its layer count and the shapes of those projections. The
inference server's ModelConfig provides them; the store sidecar, which has no model, reads them
from the base model's Hugging Face config.json."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from loraplex.adapter_store.format.architectures import Architecture, Dims, for_model_type, model_type_of


class BaseShapes(Protocol):
    """The base model as adapter validation sees it."""

    @property
    def model_type(self) -> str: ...

    @property
    def dims(self) -> Dims: ...

    @property
    def num_layers(self) -> int: ...

    @property
    def architecture(self) -> Architecture: ...

    def projection_shapes(self) -> dict[str, tuple[int, int]]: ...


@dataclass(frozen=True, slots=True)
class HFBaseShapes:
    """BaseShapes read from a config.json (the sidecar's ``--base-config``)."""

    model_type: str
    dims: Dims

    @property
    def num_layers(self) -> int:
        return self.dims.num_layers

    @property
    def architecture(self) -> Architecture:
        return for_model_type(self.model_type)

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        return self.architecture.shapes(self.dims)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> HFBaseShapes:
        return cls(model_type=model_type_of(cfg), dims=Dims.from_hf(cfg))


def same_shapes(a: BaseShapes, b: BaseShapes) -> bool:
    """Whether an adapter that fits ``a`` fits ``b``: one family, layer count and projection shapes."""
    return (a.architecture is b.architecture and a.num_layers == b.num_layers
            and a.projection_shapes() == b.projection_shapes())
