"""Llama 2 / 3 / 3.1+ (RoPE scaling 'llama3' or 'linear')."""

from megarlhf.models.arch.llama_family import llama_family_architecture
from megarlhf.models.arch.registry import register

LLAMA = register(llama_family_architecture(
    name="llama", hf_prefix="Llama", config_class="LlamaConfig", qkv_bias=False, qk_norm=False,
))
