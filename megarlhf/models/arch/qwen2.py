"""Qwen2 / Qwen2.5: bias on the Q, K, V projections; small models tie embeddings."""

from megarlhf.models.arch.llama_family import llama_family_architecture
from megarlhf.models.arch.registry import register

QWEN2 = register(llama_family_architecture(
    name="qwen2", hf_prefix="Qwen2", config_class="Qwen2Config", qkv_bias=True, qk_norm=False,
))
