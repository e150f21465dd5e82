"""The building blocks every family's decoder is made of, as plain nn.Modules.

GQA attention over the paged KV cache (optional q/k norms, sliding window, score soft-capping and
query scale, each set by the config), the gated MLP (SiLU or tanh-GELU), RMSNorm, and the base
class of a decoder LM: token embedding (optionally scaled), layers, final norm, logits
(optionally soft-capped), and ``lora_sites``, which tells the LoRA runtime where each layer's
projections are by their role, so it never looks modules up by path.

q/k/v and gate/up are fused linears (one GEMM each); LoRA is added from outside by wrapping them
(inference_server/lora/layers.py), the model does not know. The element-wise parts (residual add
+ RMSNorm, RoPE + KV-cache write, SiLU * up) are ``loraplex.kernels.fused_ops``: one kernel each on
16-bit CUDA, the PyTorch expressions elsewhere. The residual stream is carried as (x, delta): each
norm adds the previous block's output.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from loraplex import kernels
from loraplex.adapter_store.format.architectures import Slot
from loraplex.inference_server.model.attention import AttentionMetadata, paged_attention
from loraplex.inference_server.model.config import ModelConfig
from loraplex.inference_server.model.rope import RotaryEmbedding
from loraplex.kernels import fused_ops


@dataclass(slots=True)
class ForwardBatch:
    """What one forward pass needs besides token ids: positions, cache, attention metadata."""

    positions: torch.Tensor  # int64 [T]
    kv_caches: list[torch.Tensor]  # one [2, blocks, block_size, Hkv, D] per layer
    attn: AttentionMetadata


@dataclass(frozen=True, slots=True)
class LoraSite:
    """A base projection LoRA may wrap: ``owner.<attr>`` is the linear of decoder layer ``layer``
    whose output the ``slot``'s fused LoRA call adds to."""

    layer: int
    slot: Slot
    owner: nn.Module
    attr: str


class RMSNorm(nn.Module):
    """weight * normalize(x). A checkpoint's (1 + w) form (Gemma) is folded into the weight when
    it loads (see the family's weight map)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + delta), x + delta); x is updated in place on the fused (CUDA) path."""
        return fused_ops.add_rms_norm(x, delta, self.weight, self.eps)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """The norm over the last dim of a [T, H, D] view (q/k norms), as a new tensor."""
        return fused_ops.add_rms_norm_reference(x, None, self.weight, self.eps)[0]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, rotary_kind: str = "global") -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_proj_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim**-0.5
        self.window = cfg.window(layer)
        self.softcap = cfg.attn_softcap
        self.rotary_kind = rotary_kind

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding, batch: ForwardBatch) -> torch.Tensor:
        cache = batch.kv_caches[self.layer]
        qkv = self.qkv_proj(x)
        if self.q_norm is not None:
            self._norm_heads(qkv)
        q = fused_ops.rope_and_cache(qkv, batch.positions, rotary.cos, rotary.sin, cache,
                                     batch.attn.slot_mapping, self.num_heads, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, cache, batch.attn, self.scale, self.window, self.softcap)
        return self.o_proj(out.reshape(-1, self.q_size))

    def _norm_heads(self, qkv: torch.Tensor) -> None:
        """q and k of the fused rows normalised per head, in place (before RoPE)."""
        rows, d = qkv.shape[0], self.head_dim
        q = qkv[:, : self.q_size].view(rows, self.num_heads, d)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(rows, self.num_kv_heads, d)
        q.copy_(self.q_norm.heads(q))
        k.copy_(self.k_norm.heads(k))


class GatedMLP(nn.Module):
    """down(act(gate) * up), gate and up one fused linear [gate | up]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = cfg.hidden_act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.act == "silu":
            return self.down_proj(fused_ops.silu_and_mul(gate_up))
        gate, up = gate_up.split(gate_up.shape[-1] // 2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class DecoderLM(nn.Module):
    """Token ids [T] (rows of many sequences, flattened) -> hidden [T, H]; logits for chosen rows.

    A family's model subclasses it with its own ``layers`` (each with ``self_attn`` and ``mlp``, and
    ``forward(x, delta, rotary, batch) -> (x, delta)``)."""

    def __init__(self, cfg: ModelConfig, layers: list[nn.Module]) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary: RotaryEmbedding | None = None
        self.local_rotary: RotaryEmbedding | None = None

    def init_rotary(self, device: torch.device | str) -> None:
        """Build the cos/sin tables on ``device`` (after a meta-device build): the global ones, and
        the windowed layers' own where the family gives them another base (Gemma 3)."""
        cfg = self.config
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta,
                                      cfg.rope_scaling).to(device)
        if cfg.local_rope_theta is not None:
            self.local_rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.local_rope_theta,
                                                None).to(device)

    def rotary_of(self, attention: Attention) -> RotaryEmbedding:
        return self.local_rotary if attention.rotary_kind == "local" else self.rotary

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Each layer takes the residual stream and the previous block's output (x, delta) and
        returns the next pair; the final norm adds the last delta."""
        x, delta = self.embed(input_ids), None
        for layer in self.layers:
            x, delta = layer(x, delta, self.rotary_of(layer.self_attn), batch)
        return self.norm(x, delta)[0]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.config.embed_scale is not None:  # float32, then the weights' dtype, as transformers rounds it
            x = x * torch.tensor(self.config.embed_scale, dtype=torch.float32).to(x.dtype)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = kernels.linear(hidden, weight)  # the CPU's few-rows form at decode (kernels/dense.py)
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def lora_sites(self) -> Iterator[LoraSite]:
        """Every decoder layer's four projections LoRA adds to, by role."""
        for index, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            yield LoraSite(index, Slot.QKV, attn, "qkv_proj")
            yield LoraSite(index, Slot.O, attn, "o_proj")
            yield LoraSite(index, Slot.GATE_UP, mlp, "gate_up_proj")
            yield LoraSite(index, Slot.DOWN, mlp, "down_proj")
