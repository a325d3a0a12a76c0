"""Mistral: the Llama layout; a sliding window shorter than the context caps the context."""

from megarlhf.models.arch.llama_family import llama_family_architecture
from megarlhf.models.arch.registry import register

MISTRAL = register(llama_family_architecture(
    name="mistral", hf_prefix="Mistral", config_class="MistralConfig", qkv_bias=False,
    qk_norm=False, hf_overrides={"sliding_window": None},
))
