"""Bytes per GPU: one role's model state, and the transient tensors of a forward/backward pass
or a rollout. Pure arithmetic on shapes; megarlhf.plan.job says which terms a PPO job has.

Legend: N parameters on the rank (plan.params), P bytes per parameter element (the param
dtype), DP data-parallel size, b rows per micro-batch, s tokens per row (prompt + response),
h hidden size, f FFN width, q = heads x head_dim, k = kv_heads x head_dim, t = TP size,
V the TP-padded vocabulary.

Model state of a trained role, as megarlhf.engine.train builds it (megatron-core DDP with
grad_reduce_in_fp32=True and the distributed optimizer over torch Adam):

    weights    N x P                 the DDP parameter buffer
    grads      N x 4                 fp32 main-grad buffer, whatever the param dtype
    optimizer  N x (8 + 4m) / DP     Adam exp_avg + exp_avg_sq in fp32, plus fp32 master
                                     weights (m = 1) when params are 16-bit; fp32 params are
                                     their own master weights (m = 0). Sharded over DP.

A frozen role (no optimizer) holds its weights only.

Activations kept for backward, per layer and micro-batch (the accounting of Korthikanti et
al. 2022, "Reducing Activation Recomputation in Large Transformer Models", sec. 4.1, redone
for a Llama layer: RMSNorm, GQA, SwiGLU, no dropout, and flash/memory-efficient attention,
which keeps no s x s score tensor):

    b s P [ 4h/x + (2q + 2k)/t + 3f/t ] + b s (heads/t) 4

    4h      the two norms' inputs and outputs (x = t with sequence parallelism, else 1)
    2q+2k   attention inputs q, k, v and its output (the projection's input)
    3f      gate and up (SwiGLU's inputs) and SwiGLU's output (the down projection's input)
    last    attention's fp32 log-sum-exp per head

plus the padding-aware causal mask (b s^2 bytes, bool) per micro-batch. With full
recomputation only each layer's input (b s h P / x) is kept, and one layer's activations are
rebuilt at a time. A pipeline rank holds the activations of several micro-batches at once:
1F1B runs min(PP - rank, micro-batches) forwards ahead of their backwards; the interleaved
schedule (VPP chunks) min(VPP x micro-batches, 2 (PP - rank - 1) + (VPP - 1) PP + 1) chunk
forwards, as megatron-core's schedules warm up.

LM logits on the last stage, one micro-batch: b s V/t x (P + 12): the output layer's logits
and parallel/vocab.py's three fp32 tensors (the float copy, shifted logits, their exp kept
for backward).

KV cache: 2 (keys, values) x layers x rows x s x k/t x P.
"""

from __future__ import annotations

import math

from megarlhf.models.config import ModelConfig
from megarlhf.parallel.mesh import ParallelConfig

GRAD_BYTES = 4
ADAM_STATE_BYTES = 8
MASTER_WEIGHT_BYTES = 4
FP32_BYTES = 4


def model_state(params: int, param_bytes: int, *, trained: bool, dp: int) -> dict[str, int]:
    """{'weights', 'grads', 'optimizer'} bytes of one role on one rank (frozen: weights only)."""
    state = {"weights": params * param_bytes}
    if trained:
        per_param = ADAM_STATE_BYTES + (MASTER_WEIGHT_BYTES if param_bytes < FP32_BYTES else 0)
        state["grads"] = params * GRAD_BYTES
        state["optimizer"] = math.ceil(params / dp) * per_param
    return state


def layer_activations(model: ModelConfig, parallel: ParallelConfig, rows: int, seq: int,
                      param_bytes: int) -> int:
    """Bytes one layer keeps for backward for one micro-batch (no recomputation)."""
    t = parallel.tensor_parallel
    x = t if parallel.sequence_parallel else 1
    h, f = model.hidden_size, model.ffn_hidden_size
    q = model.num_attention_heads * model.kv_channels
    k = model.kv_heads * model.kv_channels
    tokens = rows * seq
    per_token = param_bytes * (4 * h / x + (2 * q + 2 * k) / t + 3 * f / t)
    per_token += model.num_attention_heads / t * FP32_BYTES
    return math.ceil(tokens * per_token)


def layer_input(model: ModelConfig, parallel: ParallelConfig, rows: int, seq: int,
                param_bytes: int) -> int:
    """Bytes of one layer's input for one micro-batch: all full recomputation keeps."""
    x = parallel.tensor_parallel if parallel.sequence_parallel else 1
    return math.ceil(rows * seq * model.hidden_size * param_bytes / x)


def forwards_in_flight(parallel: ParallelConfig, pp_rank: int, microbatches: int) -> int:
    """Chunk forwards whose activations pipeline rank `pp_rank` holds at its peak."""
    pp, vpp = parallel.pipeline_parallel, parallel.num_chunks
    if vpp == 1:
        return min(pp - pp_rank, microbatches)
    return min(vpp * microbatches, 2 * (pp - pp_rank - 1) + (vpp - 1) * pp + 1)


def in_flight_layers(model: ModelConfig, parallel: ParallelConfig, pp_rank: int,
                     microbatches: int) -> int:
    """Layer-micro-batches whose activations pipeline rank `pp_rank` holds at its peak."""
    chunk_layers = model.num_layers // (parallel.pipeline_parallel * parallel.num_chunks)
    return forwards_in_flight(parallel, pp_rank, microbatches) * chunk_layers


def train_activations(model: ModelConfig, parallel: ParallelConfig, pp_rank: int, *, rows: int,
                      seq: int, microbatches: int, param_bytes: int, recompute: bool) -> int:
    """Peak bytes of activations kept for backward on pipeline rank `pp_rank`."""
    held = in_flight_layers(model, parallel, pp_rank, microbatches)
    # A micro-batch's mask is shared by its chunks: at most one per forward in flight.
    masks = min(microbatches, forwards_in_flight(parallel, pp_rank, microbatches)) \
        * rows * seq * seq
    layer = layer_activations(model, parallel, rows, seq, param_bytes)
    if recompute:
        return held * layer_input(model, parallel, rows, seq, param_bytes) + layer + masks
    return held * layer + masks


def lm_logits(model: ModelConfig, tp: int, rows: int, seq: int, param_bytes: int) -> int:
    """Bytes of one micro-batch's vocab-parallel logits and their fp32 softmax workspace."""
    return rows * seq * (model.padded_vocab_size(tp) // tp) * (param_bytes + 3 * FP32_BYTES)


def kv_cache(model: ModelConfig, tp: int, rows: int, seq: int, param_bytes: int) -> int:
    """Bytes of keys and values of every layer for `rows` sequences of `seq` tokens."""
    return 2 * model.num_layers * rows * seq * model.kv_heads // tp * model.kv_channels \
        * param_bytes
