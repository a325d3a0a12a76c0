"""Layers that megatron-core's local spec lacks or gets subtly different from HF.

- `RMSNorm`: computes in fp32 and casts back before the weight, exactly like HF Llama/Qwen and
  vLLM, so trainer and rollout logprobs agree in bf16; marks its weight for the TP all-reduce
  megatron-core does under sequence parallelism (torch's RMSNorm refuses sequence parallel).
- `SDPAttention`: core attention over `torch.nn.functional.scaled_dot_product_attention`, which
  picks flash / memory-efficient kernels on GPU without Transformer Engine.
- `ValueHead`: hidden -> one scalar per token for critic and reward models.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.transformer_config import TransformerConfig


class RMSNorm(torch.nn.Module):
    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-5, **_):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        # Read by megatron-core's finalize_model_grads: under sequence parallelism each TP rank
        # sees a slice of the sequence, so the weight's gradient must be summed across TP.
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class SDPAttention(DotProductAttention):
    """Drop-in core attention ([s, b, heads, d] in, [s, b, heads*d] out) over torch SDPA.

    `attention_mask` follows megatron-core's convention: True marks a masked-out position.
    """

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError(
                "SDPAttention takes neither packed sequences (models.packed.PackedAttention "
                "runs them through it) nor an attention bias"
            )
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [b, heads, s, d]
        sq, sk = q.shape[2], k.shape[2]
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        attn_mask, is_causal = None, False
        if attention_mask is not None:
            attn_mask = ~attention_mask
        elif mask_type == AttnMaskType.causal and sq > 1:
            if sq == sk:
                is_causal = True
            else:  # queries are the last sq positions of sk keys (KV cache)
                attn_mask = torch.ones(sq, sk, dtype=torch.bool, device=q.device).tril(sk - sq)
        out = F.scaled_dot_product_attention(
            q, k, v,
            attn_mask=attn_mask,
            dropout_p=self.attention_dropout.p if self.training else 0.0,
            is_causal=is_causal,
            scale=self.softmax_scale,
            enable_gqa=q.shape[1] != k.shape[1],
        )
        return out.permute(2, 0, 1, 3).reshape(sq, out.shape[0], -1)


class ValueHead(torch.nn.Module):
    """Linear hidden -> 1, replicated on every TP rank of the last pipeline stage.

    Under sequence parallelism each TP rank scores its slice of the sequence, then the slices
    are gathered; the head's gradient is summed across TP like a norm weight's.
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.linear = torch.nn.Linear(config.hidden_size, 1, bias=False, dtype=config.params_dtype)
        torch.nn.init.normal_(self.linear.weight, mean=0.0, std=config.init_method_std)
        self.linear.weight.sequence_parallel = config.sequence_parallel

    def forward(self, hidden_SBH: torch.Tensor) -> torch.Tensor:
        values_SB1 = self.linear(hidden_SBH)
        if self.config.sequence_parallel:
            # The loss downstream is computed identically on every TP rank, so the backward
            # of this gather must split (not reduce-scatter) the gradient.
            values_SB1 = tensor_parallel.gather_from_sequence_parallel_region(
                values_SB1, tensor_parallel_output_grad=False
            )
        return values_SB1.squeeze(-1).transpose(0, 1).float()  # [b, s]
