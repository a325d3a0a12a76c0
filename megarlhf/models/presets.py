"""Named model sizes used by the demo, tests, benchmarks and the memory planner."""

from __future__ import annotations

from megarlhf.models.config import ModelConfig, RopeScaling

PRESETS = {
    # 4 layers, GQA 4:2, Llama-3.1 RoPE scaling: exercises every code path in seconds on CPU.
    "tiny": ModelConfig(
        vocab_size=300, hidden_size=64, ffn_hidden_size=128, num_layers=4,
        num_attention_heads=4, num_kv_heads=2, max_position_embeddings=256,
        rope_theta=10000.0, make_vocab_size_divisible_by=16,
        rope_scaling=RopeScaling(factor=4.0, original_max_position_embeddings=64),
    ),
    # ~1.2B Llama-style model for GPU throughput runs.
    "llama-1b": ModelConfig(
        vocab_size=128256, hidden_size=2048, ffn_hidden_size=8192, num_layers=16,
        num_attention_heads=32, num_kv_heads=8, max_position_embeddings=8192,
        rope_theta=500000.0, tie_embeddings=True,
        rope_scaling=RopeScaling(factor=32.0, original_max_position_embeddings=8192),
    ),
    # The shapes below are the public HF config.json values of each model, so `preset:NAME`
    # plans (megarlhf plan) and meta-device builds match the converted checkpoints exactly.
    # meta-llama/Meta-Llama-3-8B
    "llama3-8b": ModelConfig(
        vocab_size=128256, hidden_size=4096, ffn_hidden_size=14336, num_layers=32,
        num_attention_heads=32, num_kv_heads=8, max_position_embeddings=8192,
        rope_theta=500000.0, norm_eps=1e-5,
    ),
    # meta-llama/Meta-Llama-3-70B
    "llama3-70b": ModelConfig(
        vocab_size=128256, hidden_size=8192, ffn_hidden_size=28672, num_layers=80,
        num_attention_heads=64, num_kv_heads=8, max_position_embeddings=8192,
        rope_theta=500000.0, norm_eps=1e-5,
    ),
    # Qwen/Qwen2.5-7B (base; 131072 positions, as the long-response recipe needs).
    "qwen2.5-7b": ModelConfig(
        vocab_size=152064, hidden_size=3584, ffn_hidden_size=18944, num_layers=28,
        num_attention_heads=28, num_kv_heads=4, max_position_embeddings=131072,
        rope_theta=1000000.0, norm_eps=1e-6, qkv_bias=True,
    ),
    # Qwen/Qwen2.5-72B (base; the Instruct model has norm_eps=1e-6 and a 32768 context).
    # Sliding window is off in its config (use_sliding_window=false), so attention is full.
    "qwen2.5-72b": ModelConfig(
        vocab_size=152064, hidden_size=8192, ffn_hidden_size=29568, num_layers=80,
        num_attention_heads=64, num_kv_heads=8, max_position_embeddings=131072,
        rope_theta=1000000.0, norm_eps=1e-5, qkv_bias=True,
    ),
    # Qwen/Qwen3-30B-A3B: 128 experts of width 768 per layer, 8 per token, renormalised.
    "qwen3-30b-a3b": ModelConfig(
        vocab_size=151936, hidden_size=2048, ffn_hidden_size=6144, num_layers=48,
        num_attention_heads=32, num_kv_heads=4, head_dim=128, max_position_embeddings=40960,
        rope_theta=1000000.0, norm_eps=1e-6, qk_norm=True, num_experts=128,
        moe_ffn_hidden_size=768, moe_router_topk=8,
    ),
    # mistralai/Mixtral-8x7B-v0.1: 8 experts of width 14336 per layer, 2 per token.
    "mixtral-8x7b": ModelConfig(
        vocab_size=32000, hidden_size=4096, ffn_hidden_size=14336, num_layers=32,
        num_attention_heads=32, num_kv_heads=8, max_position_embeddings=32768,
        rope_theta=1000000.0, norm_eps=1e-5, num_experts=8, moe_ffn_hidden_size=14336,
        moe_router_topk=2,
    ),
}


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]
