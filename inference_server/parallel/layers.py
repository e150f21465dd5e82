"""The modules tensor parallelism swaps into a built model: row-parallel linear, vocab-parallel
embedding, and the wrapper whose logits are gathered over the vocabulary shards."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from loraplex.inference_server.model.config import ModelConfig
from loraplex.inference_server.model.layers import LoraSite
from loraplex.inference_server.parallel.group import TPGroup


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x_r @ W_r^T): the rank holds the input columns of its shard.

    ``partial`` is the local product without the reduce, so a LoRA wrapper can add its own
    partial sum first and share the one all-reduce (see parallel/lora.py)."""

    group: TPGroup

    @classmethod
    def from_linear(cls, linear: nn.Linear, weight: torch.Tensor, group: TPGroup) -> "RowParallelLinear":
        if linear.bias is not None:
            raise ValueError("row-parallel projections with a bias are not supported (Llama o/down have none)")
        out = cls(weight.shape[1], weight.shape[0], bias=False, device="meta")
        out.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        out.group = group
        return out

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.partial(x))


class VocabParallelEmbedding(nn.Embedding):
    """Rows [vocab_start, vocab_end) of the table (padded to the shard size); ids outside the
    shard give zeros, and the all-reduce adds the one rank that holds each id."""

    group: TPGroup
    vocab_start: int
    vocab_end: int

    @classmethod
    def from_weight(cls, weight: torch.Tensor, start: int, end: int, group: TPGroup) -> "VocabParallelEmbedding":
        out = cls(weight.shape[0], weight.shape[1], device="meta")
        out.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        out.group, out.vocab_start, out.vocab_end = group, start, end
        return out

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.vocab_end - self.vocab_start)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.group.all_reduce(out)


class TensorParallelLM(nn.Module):
    """A sharded Llama-family model as the model runner sees it.

    ``forward`` is the model's; ``compute_logits`` returns the full-vocabulary logits on rank
    0 (the shards gathered) and None on the other ranks, which must still call it.
    """

    def __init__(self, model: nn.Module, group: TPGroup, local: ModelConfig) -> None:
        super().__init__()
        self.model = model
        self.group = group
        self.local_config = local

    @property
    def config(self) -> ModelConfig:
        return self.model.config

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def lora_sites(self) -> Iterator[LoraSite]:
        return self.model.lora_sites()

    def forward(self, input_ids: torch.Tensor, batch) -> torch.Tensor:
        return self.model(input_ids, batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = self.group.gather_last_dim(self.model.compute_logits(hidden))
        return None if logits is None else logits[..., : self.config.vocab_size]
