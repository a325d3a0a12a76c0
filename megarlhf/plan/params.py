"""Exact parameter counts of the model chunks one rank holds, without building them.

Every TP rank of a pipeline stage holds the same count: TP splits each weight matrix evenly
(heads, KV heads and the FFN width must divide by TP, and the vocabulary is padded to a
multiple of TP), while norms and the value head are replicated. So a position in the layout is
just (pipeline rank, virtual chunk). The counts follow megarlhf.models.gpt.build_model:

- a layer: fused QKV (+ bias for Qwen2), output projection, fused gate/up, down projection,
  two RMSNorm weights (+ per-head q/k norms for Qwen3); in a mixture-of-experts layer the MLP
  is the router ([experts, hidden], replicated on every rank) and this rank's num_experts /
  EP experts, each a gate/up and down projection split over the expert-TP ranks;
- the first chunk of pipeline rank 0 holds the (padded) word embedding;
- the last chunk of the last pipeline rank holds the final norm and either the LM output layer
  or the value head. A tied LM output layer has no weight of its own only where it sits on the
  same chunk as the embedding (PP=1); otherwise the last stage holds a synchronised copy.
"""

from __future__ import annotations

from megarlhf.models.config import ModelConfig
from megarlhf.models.lora import ROW_PARALLEL, LoraConfig, projection_shapes
from megarlhf.parallel.mesh import ParallelConfig


def expert_layer_params(model: ModelConfig, parallel: ParallelConfig) -> int:
    """Parameters of one layer's experts on one rank (0 for a dense model)."""
    if not model.is_moe:
        return 0
    local = model.num_experts // parallel.expert_parallel
    return local * 3 * model.moe_ffn_hidden_size * model.hidden_size // parallel.expert_tp


def layer_params(model: ModelConfig, parallel: ParallelConfig) -> int:
    """Parameters of one transformer layer on one rank (experts included)."""
    h, tp = model.hidden_size, parallel.tensor_parallel
    q = model.num_attention_heads * model.kv_channels
    kv = model.kv_heads * model.kv_channels
    split = (q + 2 * kv) * h + q * h + (0 if model.is_moe else 3 * model.ffn_hidden_size * h)
    if model.qkv_bias:
        split += q + 2 * kv
    replicated = 2 * h + (2 * model.kv_channels if model.qk_norm else 0)
    if model.is_moe:
        replicated += model.num_experts * h  # the router
    return split // tp + replicated + expert_layer_params(model, parallel)


def vocab_rows(model: ModelConfig, tp: int) -> int:
    """Rows of the word embedding (and of the LM output layer) on one TP rank."""
    return model.padded_vocab_size(tp) // tp


def chunk_params(model: ModelConfig, parallel: ParallelConfig, pp_rank: int, chunk: int, *,
                 value_head: bool) -> int:
    """Parameters of virtual chunk `chunk` of pipeline rank `pp_rank`, on any of its TP ranks."""
    tp, pp, vpp = parallel.tensor_parallel, parallel.pipeline_parallel, parallel.num_chunks
    model.check_parallel(parallel)
    if not (0 <= pp_rank < pp and 0 <= chunk < vpp):
        raise ValueError(f"no position (pp_rank={pp_rank}, chunk={chunk}) in a layout with "
                         f"PP={pp} and {vpp} chunk(s) per rank")
    h = model.hidden_size
    first = pp_rank == 0 and chunk == 0
    last = pp_rank == pp - 1 and chunk == vpp - 1
    count = model.num_layers // (pp * vpp) * layer_params(model, parallel)
    if first:
        count += vocab_rows(model, tp) * h
    if last:
        count += h  # final norm
        if value_head:
            count += h
        elif not (model.tie_embeddings and first):
            count += vocab_rows(model, tp) * h
    return count


def rank_params(model: ModelConfig, parallel: ParallelConfig, pp_rank: int, *,
                value_head: bool = False) -> int:
    """Parameters held by one rank at pipeline rank `pp_rank` (all its virtual chunks)."""
    return sum(chunk_params(model, parallel, pp_rank, c, value_head=value_head)
               for c in range(parallel.num_chunks))


def rank_expert_params(model: ModelConfig, parallel: ParallelConfig) -> int:
    """Expert parameters held by one rank (every pipeline rank holds as many layers): the
    part of rank_params the optimizer shards over the expert data-parallel ranks."""
    layers = model.num_layers // parallel.pipeline_parallel
    return layers * expert_layer_params(model, parallel)


def rank_adapter_params(model: ModelConfig, parallel: ParallelConfig, lora: LoraConfig) -> int:
    """LoRA parameters held by one rank (models/lora.py): per layer and targeted projection
    r x (in + out), the factor its base layer splits divided by TP (column parallel: B,
    row parallel: A)."""
    tp, per_layer = parallel.tensor_parallel, 0
    for p in lora.targets:
        inp, out = projection_shapes(model)[p]
        per_layer += (lora.rank * inp // tp + out * lora.rank if p in ROW_PARALLEL
                      else lora.rank * inp + out * lora.rank // tp)
    return model.num_layers // parallel.pipeline_parallel * per_layer


def total_params(model: ModelConfig, *, value_head: bool = False) -> int:
    """Parameters of the whole model at TP1/PP1 (vocabulary padded for TP1)."""
    return rank_params(model, ParallelConfig(), 0, value_head=value_head)


CHECKPOINT_OPTIMIZER_BYTES = 12
"""Bytes per trained parameter of a checkpoint's Adam state (engine/checkpoint.py, megatron-
core's fully reshardable format): an fp32 copy of the parameter and both moments, in fp32
runs too."""


def saved_bytes(model: ModelConfig, *, value_head: bool, lora: LoraConfig | None,
                param_bytes: int) -> int:
    """Tensor bytes of one trained role's checkpoint: every weight with its Adam state, or
    under LoRA the adapters and the value head with theirs (the frozen base is referenced,
    not saved)."""
    if lora is None:
        trained = total_params(model, value_head=value_head)
    else:
        head = model.hidden_size if value_head else 0  # its one output (chunk_params)
        trained = rank_adapter_params(model, ParallelConfig(), lora) + head
    return trained * (param_bytes + CHECKPOINT_OPTIMIZER_BYTES)
