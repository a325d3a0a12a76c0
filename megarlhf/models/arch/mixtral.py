"""Mixtral (8x7B, 8x22B): Mistral's attention, every layer's MLP a router over
`num_local_experts` experts of width `intermediate_size` (w1 gate, w3 up, w2 down); top-k
weights always renormalised."""

from megarlhf.models.arch.llama_family import MoEFormat, llama_family_architecture
from megarlhf.models.arch.registry import register

MIXTRAL = register(llama_family_architecture(
    name="mixtral", hf_prefix="Mixtral", config_class="MixtralConfig", qkv_bias=False,
    qk_norm=False, hf_overrides={"sliding_window": None}, moe=MoEFormat(
        block="block_sparse_moe", gate_up_down=("w1", "w3", "w2"),
        experts_field="num_local_experts", width_field="intermediate_size", norm_field=None),
))
