"""Llama-family decoder as plain nn.Modules (Llama 2/3, Mistral, Qwen2, SmolLM).

GQA attention with RoPE, RMSNorm, SiLU-gated MLP, optional tied embeddings and q/k/v bias
(Qwen2). q/k/v and gate/up are fused linears (one GEMM each); LoRA is added from outside
by wrapping these linears (inference_server/lora/layers.py), the model does not know.
The element-wise parts (residual add + RMSNorm, RoPE + KV-cache write, SiLU * up) are
``loraplex.kernels.fused_ops``: one kernel each on 16-bit CUDA, the PyTorch expressions elsewhere.
The residual stream is carried as (x, delta): each norm adds the previous block's output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from loraplex import kernels
from loraplex.kernels import fused_ops
from loraplex.inference_server.model.attention import AttentionMetadata, paged_attention
from loraplex.inference_server.model.config import ModelConfig
from loraplex.inference_server.model.rope import RotaryEmbedding


@dataclass(slots=True)
class ForwardBatch:
    """What one forward pass needs besides token ids: positions, cache, attention metadata."""

    positions: torch.Tensor  # int64 [T]
    kv_caches: list[torch.Tensor]  # one [2, blocks, block_size, Hkv, D] per layer
    attn: AttentionMetadata


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + delta), x + delta); x is updated in place on the fused (CUDA) path."""
        return fused_ops.add_rms_norm(x, delta, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.q_size, cfg.kv_size
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=False)
        self.scale = cfg.head_dim**-0.5

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding, batch: ForwardBatch) -> torch.Tensor:
        cache = batch.kv_caches[self.layer]
        q = fused_ops.rope_and_cache(self.qkv_proj(x), batch.positions, rotary.cos, rotary.sin, cache,
                                     batch.attn.slot_mapping, self.num_heads, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, cache, batch.attn, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused_ops.silu_and_mul(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, x: torch.Tensor, delta: torch.Tensor | None, rotary: RotaryEmbedding, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual stream x plus the previous block's output delta -> (stream, this layer's MLP output)."""
        h, x = self.input_layernorm(x, delta)
        h, x = self.post_attention_layernorm(x, self.self_attn(h, rotary, batch))
        return x, self.mlp(h)


class LlamaForCausalLM(nn.Module):
    """Token ids [T] (rows of many sequences, flattened) -> hidden [T, H]; logits for chosen rows."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary: RotaryEmbedding | None = None

    def init_rotary(self, device: torch.device | str) -> None:
        """Build the cos/sin tables on ``device`` (after a meta-device build)."""
        cfg = self.config
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling).to(
            device
        )

    def forward(self, input_ids: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        x, delta = self.embed_tokens(input_ids), None
        for layer in self.layers:
            x, delta = layer(x, delta, self.rotary, batch)
        return self.norm(x, delta)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return kernels.linear(hidden, weight)  # the CPU's few-rows form at decode (kernels/dense.py)


MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
}
