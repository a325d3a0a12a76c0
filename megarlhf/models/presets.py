"""Named model sizes used by the demo, tests and benchmarks."""

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
}


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}")
    return PRESETS[name]
