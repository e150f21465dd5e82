"""Llama-family decoder as plain nn.Modules (Llama 2/3, Mistral, Qwen2, SmolLM).

GQA attention with RoPE, RMSNorm, SiLU-gated MLP, optional tied embeddings and q/k/v bias
(Qwen2). q/k/v and gate/up are fused linears (one GEMM each); LoRA is added from outside
by wrapping these linears (inference_server/lora/layers.py), the model does not know.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from inference_server.model.attention import AttentionMetadata, paged_attention, write_kv
from inference_server.model.config import ModelConfig
from inference_server.model.rope import RotaryEmbedding


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


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
        qkv = self.qkv_proj(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.reshape(-1, self.num_kv_heads, self.head_dim)
        q, k = rotary(batch.positions, q, k)
        cache = batch.kv_caches[self.layer]
        write_kv(cache, k, v, batch.attn.slot_mapping)
        out = paged_attention(q, cache, batch.attn, self.scale)
        return self.o_proj(out.reshape(-1, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return self.down_proj(nn.functional.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, rotary: RotaryEmbedding, batch: ForwardBatch) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rotary, batch)
        return x + self.mlp(self.post_attention_layernorm(x))


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
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, self.rotary, batch)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return nn.functional.linear(hidden, weight)


MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "mistral": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
}
