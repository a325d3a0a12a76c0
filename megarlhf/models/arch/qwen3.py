"""Qwen3 (dense): RMSNorm on each head's queries and keys; head_dim set apart from hidden."""

from megarlhf.models.arch.llama_family import llama_family_architecture
from megarlhf.models.arch.registry import register

QWEN3 = register(llama_family_architecture(
    name="qwen3", hf_prefix="Qwen3", config_class="Qwen3Config", qkv_bias=False, qk_norm=True,
))
