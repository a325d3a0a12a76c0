"""The one place where our configs become megatron-core's `TransformerConfig`."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer import TransformerConfig

from megarlhf.compat.megatron import aux_loss_split_factor
from megarlhf.models.config import ModelConfig
from megarlhf.parallel.mesh import ParallelConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
RECOMPUTE = ("none", "full", "selective")
"""Activation recomputation modes (to_transformer_config's `recompute`)."""


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def to_transformer_config(
    model: ModelConfig,
    parallel: ParallelConfig,
    *,
    dtype: torch.dtype = torch.float32,
    on_gpu: bool = False,
    calculate_per_token_loss: bool = True,
    recompute: str = "none",
) -> TransformerConfig:
    """Translate a Llama-family `ModelConfig` + layout into megatron-core's `TransformerConfig`.

    `calculate_per_token_loss=True` makes the schedules leave losses as token sums and divide
    gradients by the token count of the whole global batch, so gradients do not depend on how
    the batch is split into micro-batches or DP ranks.

    `recompute` (activation recomputation in training's backward; forward-only passes keep no
    activations, so it does nothing there): 'none'; 'full' (every layer keeps only its input
    and runs again in backward: granularity full, method uniform, 1 layer per unit);
    'selective' (megatron-core's selective granularity over the core attention, the
    softmax(QK^T)V part, named explicitly rather than left to megatron-core's default list).
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute={recompute!r} is not one of {list(RECOMPUTE)}")
    if not model.is_moe:  # a dense model sharing an MoE model's ranks: no experts to split
        parallel = parallel.without_experts()
    model.check_parallel(parallel)
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.kv_heads,
        kv_channels=model.kv_channels,
        normalization="RMSNorm",
        layernorm_epsilon=model.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model.qkv_bias,
        qk_layernorm=model.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model.init_std,
        tensor_model_parallel_size=parallel.tensor_parallel,
        pipeline_model_parallel_size=parallel.pipeline_parallel,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_parallel,
        sequence_parallel=parallel.sequence_parallel,
        context_parallel_size=parallel.context_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        calculate_per_token_loss=calculate_per_token_loss,
        # CPU init builds each full weight from one seed and slices it, so every layout starts
        # from identical weights; on GPU weights come from checkpoints, and GPU init is faster.
        use_cpu_initialization=not on_gpu,
        # Fused kernels exist only on GPU.
        bias_activation_fusion=on_gpu,
        # Off everywhere: the local spec's fused causal softmax ignores the explicit mask our
        # batches carry (left padding, packed documents, a CP rank's query rows); the GPU
        # paths are Transformer Engine's and SDPA's attention, which do not use it.
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        mrope_section=list(model.mrope_section) if model.mrope_section else None,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        # Batched p2p on gloo swaps micro-batch activations in the interleaved schedule
        # (measured: silent wrong loss); NCCL batches correctly.
        batch_p2p_comm=on_gpu,
        recompute_granularity=None if recompute == "none" else recompute,
        recompute_method="uniform" if recompute == "full" else None,
        recompute_num_layers=1 if recompute == "full" else None,
        recompute_modules=["core_attn"] if recompute == "selective" else None,
        expert_model_parallel_size=parallel.expert_parallel,
        expert_tensor_parallel_size=parallel.expert_tp,
        **(_moe_fields(model, parallel, on_gpu) if model.is_moe else {}),
    )


def _moe_fields(model: ModelConfig, parallel: ParallelConfig, on_gpu: bool) -> dict:
    """The router as HF computes it: top-k of the softmax over all experts, renormalised
    (= softmax over the top-k logits: megatron-core's default order) or not (softmax first,
    `moe_router_pre_softmax`); dropless (no capacity factor), so every token reaches its k
    experts whatever the imbalance."""
    # The same load-balancing loss weight at every layout, whichever megatron-core version.
    split = aux_loss_split_factor(parallel.context_parallel * (
        parallel.tensor_parallel if parallel.sequence_parallel else 1))
    return dict(
        num_moe_experts=model.num_experts,
        moe_ffn_hidden_size=model.moe_ffn_hidden_size,
        moe_router_topk=model.moe_router_topk,
        moe_router_score_function="softmax",
        moe_router_pre_softmax=not model.moe_norm_topk,
        moe_router_load_balancing_type="aux_loss" if model.moe_aux_loss_coeff else "none",
        moe_aux_loss_coeff=model.moe_aux_loss_coeff * split,
        # The all-to-all dispatcher opens a CUDA stream; on CPU every rank all-gathers the
        # tokens of its expert-parallel group instead (same routing, same results).
        moe_token_dispatcher_type="alltoall" if on_gpu else "allgather",
        moe_grouped_gemm=on_gpu,
        moe_permute_fusion=False,
        # moe_router_dtype stays unset: the router's logits in the model's dtype, as HF and
        # vLLM compute them, so that near-ties pick the same experts in trainer and engine.
    )
