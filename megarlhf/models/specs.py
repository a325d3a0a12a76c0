"""Layer specs: which module implements each part of a transformer layer.

- "local": megatron-core's own modules + our RMSNorm (attention as matmuls and a softmax over
  the whole score matrix, GQA key/value heads copied per query head);
- "sdpa": as local, with attention through torch SDPA (flash kernels on a plain PyTorch GPU,
  and torch's fused CPU kernel, which reads GQA heads without copying them);
- "te": Transformer Engine modules (fused kernels; needs `transformer_engine` installed);
- "auto": sdpa. On CPU too: on SmolLM2-135M's shape (fp32, one core; bench/
  bench_cpu_layer_spec.py) a decode step of the Megatron engine takes 0.84x local's time at
  64 new tokens and a forward and backward of 4 x 316 tokens 0.93x (bf16: about equal),
  local's copies of the KV cache growing with its length.

Micro-batches that pack documents run in the packed THD layout (models/packed.py): TE's
attention reads the segments natively, and at CP1 the local and sdpa cores run inside
PackedAttention, which runs each segment alone. Other rows run under a document mask, which
TE's causal attention would ignore (left-padded rows would attend to their padding). TE is
not verified here (no test or GPU run has had Transformer Engine installed), so the stages
refuse it before launch (TE_REFUSED) and "auto" never picks it; only bench/gpu's TE item
builds it, by name, on causal rows.

Under context parallelism (CP > 1) the local and sdpa attentions run inside
ContextParallelAttention (models/context_parallel.py); Transformer Engine's own CP attention
is not used: it takes no padding mask in our [batch, seq] layout.
"""

from __future__ import annotations

import dataclasses
import importlib.util

from megatron.core.models.gpt import gpt_layer_specs
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlockSubmodules,
    get_num_layers_to_build,
)
from megatron.core.transformer.transformer_config import TransformerConfig

from megarlhf.compat.megatron import with_mlp_submodules
from megarlhf.models.context_parallel import ContextParallelAttention
from megarlhf.models.layers import RMSNorm, SDPAttention
from megarlhf.models.lora import LoraConfig, layer_classes
from megarlhf.models.packed import PackedAttention

LAYER_SPECS = ("auto", "local", "sdpa", "te")
TE_REFUSED = ("Transformer Engine is not verified here yet (padded rows would need a mask it "
              "ignores, and its packed-sequence attention has not run with TE installed); use "
              "auto, sdpa or local")
"""Why the stages refuse layer spec 'te' before launch."""


def te_available() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def resolve_layer_spec(name: str, on_gpu: bool, context_parallel: int = 1) -> str:
    if name not in LAYER_SPECS:
        raise ValueError(f"unknown layer spec {name!r}; choose one of {LAYER_SPECS}")
    if name == "auto":
        return "sdpa"
    if name == "te" and context_parallel > 1:
        raise ValueError(f"context_parallel={context_parallel} runs with the 'sdpa' or "
                         f"'local' layer spec (or 'auto'); Transformer Engine's CP attention "
                         f"takes no padding mask in megarlhf's batch layout")
    if name == "te" and not (on_gpu and te_available()):
        raise ValueError(
            "layer spec 'te' needs a GPU and Transformer Engine installed; use 'auto', 'sdpa' "
            "or 'local'"
        )
    return name


def layer_spec(name: str, *, qk_norm: bool, context_parallel: int = 1,
               num_experts: int | None = None, lora: LoraConfig | None = None) -> ModuleSpec:
    """The ModuleSpec of one transformer layer for a resolved spec name; with `num_experts`
    its MLP is megatron-core's MoE layer (router + experts: Transformer Engine's grouped GEMM
    under 'te', one MLP per expert otherwise; both save the same checkpoint keys); with
    `lora` its linear layers carry adapters (models/lora.py; local and sdpa specs)."""
    if name == "te":
        if lora is not None:
            raise ValueError("LoRA adapters run with the 'local' or 'sdpa' layer spec")
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=num_experts is not None,
            qk_layernorm=qk_norm)
        if num_experts is None:
            return spec
        # TE's MoE layer saves its pre-MLP norm as 'pre_mlp_layernorm.weight', the local
        # spec (and so our converters) under the dense layer's fused name: one checkpoint
        # layout for both specs.
        keys = {**spec.submodules.sharded_state_dict_keys_map,
                "pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
        return dataclasses.replace(spec, submodules=dataclasses.replace(
            spec.submodules, sharded_state_dict_keys_map=keys))
    spec = gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=num_experts, moe_grouped_gemm=False, qk_layernorm=qk_norm,
        normalization="RMSNorm")
    attn = spec.submodules.self_attention
    core = SDPAttention if name == "sdpa" else attn.submodules.core_attention
    wrapper = ContextParallelAttention if context_parallel > 1 else PackedAttention
    core = ModuleSpec(module=wrapper, params={"inner": core})
    linears = layer_classes(lora) if lora is not None else {}
    attn_sub = dataclasses.replace(
        attn.submodules,
        **{k: v for k, v in linears.items() if k in ("linear_qkv", "linear_proj")},
        core_attention=core,
        q_layernorm=RMSNorm if qk_norm else IdentityOp,
        k_layernorm=RMSNorm if qk_norm else IdentityOp,
    )
    mlp = spec.submodules.mlp
    mlp_linears = {k: v for k, v in linears.items() if k in ("linear_fc1", "linear_fc2")}
    if mlp_linears:  # dense MLPs only (lora.check_model refuses MoE targets)
        mlp = with_mlp_submodules(mlp, **mlp_linears)
    layer_sub = dataclasses.replace(
        spec.submodules,
        mlp=mlp,
        input_layernorm=RMSNorm,
        pre_mlp_layernorm=RMSNorm,
        self_attention=dataclasses.replace(attn, submodules=attn_sub),
    )
    return dataclasses.replace(spec, submodules=layer_sub)


def block_spec(
    name: str, config: TransformerConfig, *, qk_norm: bool, vp_stage: int | None, pp_rank: int,
    lora: LoraConfig | None = None,
) -> TransformerBlockSubmodules:
    """Layers of one pipeline stage (or virtual chunk) plus the final norm."""
    if name == "te":
        from megatron.core.extensions.transformer_engine import TENorm as final_norm
    else:
        final_norm = RMSNorm
    num_layers = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return TransformerBlockSubmodules(
        layer_specs=[layer_spec(name, qk_norm=qk_norm,
                                context_parallel=config.context_parallel_size,
                                num_experts=config.num_moe_experts,
                                lora=lora)] * num_layers,
        layer_norm=final_norm
    )
