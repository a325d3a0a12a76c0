"""Qwen3-MoE (Qwen3-30B-A3B, 235B-A22B): Qwen3's attention, every layer's MLP a router over
`num_experts` experts of width `moe_intermediate_size`; top-k weights renormalised when
`norm_topk_prob` (the released models), else kept as the softmax over all experts."""

from megarlhf.models.arch.llama_family import MoEFormat, llama_family_architecture
from megarlhf.models.arch.registry import register

QWEN3_MOE = register(llama_family_architecture(
    name="qwen3_moe", hf_prefix="Qwen3Moe", config_class="Qwen3MoeConfig", qkv_bias=False,
    qk_norm=True, moe=MoEFormat(
        block="mlp", gate_up_down=("gate_proj", "up_proj", "down_proj"),
        experts_field="num_experts", width_field="moe_intermediate_size",
        norm_field="norm_topk_prob"),
))
