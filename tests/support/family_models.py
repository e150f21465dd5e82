"""Tiny random models of each family with its quirks on (windows, soft-caps, q/k norms, fused checkpoints), and the PEFT adapters each is tested with."""

from __future__ import annotations

from pathlib import Path
import torch
from tiny_models import save_tiny_model


TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=49152, max_position_embeddings=2048, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)


WINDOW = 12  # tokens: shorter than every chat prompt (about 25 tokens) and than the 32 generated


# The adapters: q/v (PEFT's default targets), all-linear with rsLoRA, the MLP at rank 64, and
# layers 0 and 2 with rank and alpha patterns.
STANDARD_ADAPTERS = {
    "attn-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "all-r16-rslora": dict(r=16, lora_alpha=8, use_rslora=True, target_modules="all-linear"),
    "mlp-r64": dict(r=64, lora_alpha=32, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "layers-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj", "down_proj"], layers_to_transform=[0, 2],
                      rank_pattern={"down_proj": 2}, alpha_pattern={"o_proj": 2}),
}


FUSED_ADAPTERS = {  # Phi-3: PEFT targets the checkpoint's fused linears
    "qkv-r8": dict(r=8, lora_alpha=16, target_modules=["qkv_proj"]),
    "all-r16-rslora": dict(r=16, lora_alpha=8, use_rslora=True, target_modules="all-linear"),
    "mlp-r64": dict(r=64, lora_alpha=32, target_modules=["gate_up_proj", "down_proj"]),
    "layers-r4": dict(r=4, lora_alpha=8, target_modules=["qkv_proj", "o_proj", "down_proj"], layers_to_transform=[0, 2],
                      rank_pattern={"down_proj": 2}, alpha_pattern={"o_proj": 2}),
}


def _cases() -> dict[str, tuple[str, dict, dict]]:
    """family case -> (transformers class prefix, config kwargs, adapters)."""
    return {
        "llama3-rope": ("Llama", dict(TINY, rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                          "high_freq_factor": 4.0,
                                                          "original_max_position_embeddings": 64}),
                        STANDARD_ADAPTERS),
        "mistral-window": ("Mistral", dict(TINY, sliding_window=WINDOW, head_dim=16), STANDARD_ADAPTERS),
        "qwen2-window": ("Qwen2", dict(TINY, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1,
                                       tie_word_embeddings=True), STANDARD_ADAPTERS),
        "qwen3": ("Qwen3", dict(TINY, head_dim=32, tie_word_embeddings=True, use_sliding_window=True,
                                sliding_window=WINDOW, max_window_layers=2), STANDARD_ADAPTERS),
        "gemma2": ("Gemma2", dict(TINY, head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW,
                                  attn_logit_softcapping=1.5, final_logit_softcapping=3.0), STANDARD_ADAPTERS),
        "gemma3": ("Gemma3", dict(TINY, head_dim=32, query_pre_attn_scalar=24, sliding_window=WINDOW,
                                  layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                  rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                                                      "rope_theta": 1_000_000.0},
                                                   "sliding_attention": {"rope_type": "default",
                                                                         "rope_theta": 10_000.0}}),
                   STANDARD_ADAPTERS),
        "phi3": ("Phi3", dict(TINY, sliding_window=WINDOW, pad_token_id=0), FUSED_ADAPTERS),
    }


CASES = _cases()


def tiny_family_model(case: str, tokenizer_dir: Path, out: Path, **overrides) -> Path:
    """The case's random float32 model as a HF folder (its config changed by ``overrides``), every
    norm weight drawn at random too (so a norm convention mistake, such as Gemma's 1 + w, shows)."""
    import transformers

    prefix, kwargs, _ = CASES[case]
    kwargs = {**kwargs, **overrides}
    config_cls = getattr(transformers, f"{prefix}TextConfig" if prefix == "Gemma3" else f"{prefix}Config")
    model_cls = getattr(transformers, f"{prefix}ForCausalLM")
    folder = save_tiny_model(model_cls, config_cls(**kwargs), tokenizer_dir, out, seed=sum(map(ord, case)))
    with torch.random.fork_rng():
        torch.manual_seed(7)
        model = model_cls.from_pretrained(folder, dtype=torch.float32)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.add_(torch.randn_like(param) * 0.1)
        model.save_pretrained(folder, safe_serialization=True)
    return folder
