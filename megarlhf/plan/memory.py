"""Bytes per GPU: one role's model state, and the transient tensors of a forward/backward pass,
a rollout or a weight sync. Pure arithmetic on shapes; megarlhf.plan.job says which terms a
PPO job has and in which phases each is on the device.

Legend: N parameters on the rank (plan.params), P bytes per parameter element (the param
dtype), DP data-parallel size, b rows per micro-batch, s tokens per row (prompt + response),
h hidden size, f FFN width, q = heads x head_dim, k = kv_heads x head_dim, t = TP size,
x = t with sequence parallelism (else 1), c = CP size, V the TP-padded vocabulary.

Model state of a trained role, as megarlhf.engine.train builds it (megatron-core DDP with
grad_reduce_in_fp32=True and the distributed optimizer over torch Adam):

    weights    N x P                 the DDP parameter buffer
    grads      N x 4                 fp32 main-grad buffer, whatever the param dtype
    optimizer  N x (8 + 4m) / DP     Adam exp_avg + exp_avg_sq in fp32, plus fp32 master
                                     weights (m = 1) when params are 16-bit; fp32 params are
                                     their own master weights (m = 0). Sharded over DP
                                     (x CP: megatron-core's distributed optimizer shards
                                     over the DP x CP ranks, which hold the same weights).

A mixture-of-experts model's expert weights are sharded by the distributed optimizer over the
expert data-parallel ranks instead (TP x CP x DP / (EP x expert-TP): the ranks holding the same
experts).

A frozen role (no optimizer) holds its weights only. Offloading (plan.job) moves weights and
optimizer states to pinned host memory (the same bytes) and drops grads.

Activations kept for backward, per layer and micro-batch (the accounting of Korthikanti et
al. 2022, "Reducing Activation Recomputation in Large Transformer Models", sec. 4.1, redone
for a Llama layer as megatron-core builds it on GPU: Transformer Engine's fused RMSNorm +
linear and SwiGLU, unfused RoPE (apply_rope_fusion=False), no dropout, and flash /
memory-efficient attention, which keeps no s x s score tensor):

    b s P [ 4h/x + (3q + 3k)/t + 3f/t ] + b s (heads/t) 4 + 4 s d P

    4h/x    the two norms' inputs and outputs (the linears behind them keep their input
            sequence-sharded and gather it again in backward)
    3q+3k   attention: the fused QKV projection's output (q + 2k: V is a view of it, so the
            whole tensor stays), Q and K after RoPE (q + k: new tensors), and attention's
            output, the output projection's input (q)
    3f      the fused gate/up output (2f, SwiGLU's input) and SwiGLU's output (f, the down
            projection's input)
    (heads/t) 4   attention's fp32 log-sum-exp per head
    4 s d P the cos and sin tables of RoPE for Q and K (d = head_dim), per sequence position

plus the padding-aware causal mask (b s^2 bytes, bool) per micro-batch. tests/test_plan.py
checks this count tensor by tensor against what one layer saves on CPU, where our RMSNorm,
unfused SwiGLU and SDPA's additive mask keep more (the test counts those separately).

In a mixture-of-experts layer the MLP's 3f/t is replaced by what its dropless experts keep:
every token goes to k experts, so the experts of a rank receive k x (its tokens) on average,
and at most MOE_IMBALANCE times that (engine/moe_load.py: the assumption, and the ratio the
trainer measures each step, with a warning above it). Each routed token keeps its permuted
input (h) and its expert's fused gate/up output and SwiGLU output (3 f_e / e, e =
expert-TP, whose ranks also gather each other's tokens: x e); the router keeps its logits
and probabilities in fp32 (2 x experts x 4 bytes per token):

    b s [ MOE_IMBALANCE k (e h + 3 f_e) P + 8 E ] / x

Recomputation (PPOConfig.recompute, per trained role):
- 'full' (megatron-core full / uniform / 1 layer): each layer keeps only its input,
  b s h P / x, and one layer's activations are rebuilt at a time in backward;
- 'selective' (megatron-core's selective granularity over ["core_attn"], its default
  recompute_modules): the core attention runs under a checkpoint that saves its inputs (Q,
  K, V and the mask, kept anyway) and drops what the kernel itself saved: here only the fp32
  log-sum-exp, b s (heads/t) 4 per layer (its output is still kept as the output
  projection's input). With flash attention this saves little (megatron-core warns as
  much when core_attn is recomputed): the point of selective recomputation is the s x s
  scores of unfused attention, which this accounting never has.

A backward adds to the kept activations, at its peak, the larger of the last stage's logits
workspace (below) and, once those are freed, the layer being back-propagated: what
recomputation rebuilds of it (full: the layer; selective: its LSE) and its largest gradient
(the fused gate/up output's, b s 2f/t P).

A pipeline rank holds the activations of several micro-batches at once: 1F1B runs
min(PP - rank, micro-batches) forwards ahead of their backwards; the interleaved schedule
(VPP chunks) min(VPP x micro-batches, 2 (PP - rank - 1) + (VPP - 1) PP + 1) chunk forwards,
as megatron-core's schedules warm up.

The last stage also keeps the final norm's input and output (2 b s h P / x).

LM logits on the last stage, one micro-batch, b s V/t x:
- forward: P + 8 + 4c, the output layer's logits and parallel/vocab.py's fp32 tensors: the
  shifted logits and their exp (the softmax, kept for backward), and a float copy of 16-bit
  logits (c = 1; fp32 logits are their own, c = 0);
- training: the larger of that and backward's 2P + 8 (logits and softmax kept, the fp32
  gradient and its cast to the logits' dtype): P + 12 for fp32 and for 16-bit params.
Sequence parallelism does not shard them: megatron-core's output layer gathers the sequence
before its matmul, so the logits are the whole sequence's, vocab-split. A policy's LM head
runs only at the positions before response tokens (at CP1, engine/schedule.py): s is then
those positions (lm_head_positions).

Context parallelism (models/context_parallel.py) gives each rank s/c of every row: every
per-token term above and the mask's rows divide by c. Attention gathers every rank's K and V
and keeps them for backward: 2 b s k/t P per layer for the whole sequence, of which the
count above already holds this rank's b (s/c) k/t P in its 3k. The logits and their
workspace are this rank's positions' too (s/c): they become per-position log-probabilities
before the gather to whole rows (engine/schedule.py), which are a few bytes per token.

A forward-only pass (experience) keeps nothing: it holds one layer's tensors at a time (the
count above) or, on the last stage of an LM, the logits, whichever is larger.

KV cache (the Megatron engine's, allocated inside generate): 2 (keys, values) x layers x
rows x s x k/t x P. vLLM's is sized by megarlhf.rollout.sizing.

Weight sync (rollout.bridge): at most one bucket (the largest: bucket_bytes, or the largest
single tensor when bigger, never more than the whole model, in the rollout dtype; none at
TP1 x PP1, where the engines get views of the parameters) plus the TP all-gather, assembly and
split of the largest single Megatron tensor (3 x its full bytes): the bound
BridgePlan.peak_extra_bytes states.
"""

from __future__ import annotations

import math

from megarlhf.engine.moe_load import MOE_IMBALANCE
from megarlhf.models.config import ModelConfig
from megarlhf.parallel.mesh import ParallelConfig

GRAD_BYTES = 4
ADAM_STATE_BYTES = 8
MASTER_WEIGHT_BYTES = 4
FP32_BYTES = 4
RECOMPUTE = ("none", "selective", "full")


def model_state(params: int, param_bytes: int, *, trained: bool, dp: int,
                expert_params: int = 0, expert_dp: int = 1,
                trainable: int | None = None) -> dict[str, int]:
    """{'weights', 'grads', 'optimizer'} bytes of one role on one rank (frozen: weights only);
    `dp`: the ranks the optimizer states are sharded over (DP x CP); `expert_params` of the
    `params` are sharded over `expert_dp` ranks instead. `trainable`: how many of `params`
    train (LoRA adapters over a frozen base: gradients and optimizer for those only)."""
    state = {"weights": params * param_bytes}
    if trained:
        trainable = params if trainable is None else trainable
        per_param = ADAM_STATE_BYTES + (MASTER_WEIGHT_BYTES if param_bytes < FP32_BYTES else 0)
        state["grads"] = trainable * GRAD_BYTES
        state["optimizer"] = (math.ceil((trainable - expert_params) / dp)
                              + math.ceil(expert_params / expert_dp)) * per_param
    return state


def _shard(parallel: ParallelConfig) -> tuple[int, int]:
    """(t, x): the TP size, and what sequence parallelism divides the sequence by."""
    t = parallel.tensor_parallel
    return t, (t if parallel.sequence_parallel else 1)


def _local(seq: int, parallel: ParallelConfig) -> int:
    """Positions of a row this rank holds: s / c under context parallelism."""
    return math.ceil(seq / parallel.context_parallel)


def attention_lse(model: ModelConfig, parallel: ParallelConfig, rows: int, seq: int) -> int:
    """Bytes of one layer's fp32 log-sum-exp per head (what flash attention saves besides
    its inputs and output): what selective recomputation drops."""
    t, _ = _shard(parallel)
    return rows * _local(seq, parallel) * model.num_attention_heads // t * FP32_BYTES


def rope_tables(model: ModelConfig, seq: int, param_bytes: int) -> int:
    """Bytes of the cos and sin tables unfused RoPE makes for Q and for K in every layer,
    [s, 1, 1, head_dim] each, kept by its multiplications (s: this rank's positions)."""
    return 4 * seq * model.kv_channels * param_bytes


def gathered_kv(model: ModelConfig, parallel: ParallelConfig, rows: int, seq: int,
                param_bytes: int) -> int:
    """Bytes of the other CP ranks' keys and values one layer's attention keeps (0 at
    CP1)."""
    c = parallel.context_parallel
    k = model.kv_heads * model.kv_channels
    return 2 * rows * (seq - _local(seq, parallel)) * k // parallel.tensor_parallel \
        * param_bytes if c > 1 else 0


def mlp_per_token(model: ModelConfig, parallel: ParallelConfig, param_bytes: int) -> float:
    """Bytes the MLP keeps for backward per token of a row (dense: 3f/t; mixture of experts:
    its routed tokens' expert activations and the router's, see the module docstring)."""
    t, x = _shard(parallel)
    if not model.is_moe:
        return param_bytes * 3 * model.ffn_hidden_size / t
    e = parallel.expert_tp
    routed = MOE_IMBALANCE * model.moe_router_topk * (
        e * model.hidden_size + 3 * model.moe_ffn_hidden_size) * param_bytes
    return (routed + 2 * model.num_experts * FP32_BYTES) / x


def layer_activations(model: ModelConfig, parallel: ParallelConfig, rows: int, seq: int,
                      param_bytes: int) -> int:
    """Bytes one layer keeps for backward for one micro-batch (no recomputation)."""
    t, x = _shard(parallel)
    h = model.hidden_size
    q = model.num_attention_heads * model.kv_channels
    k = model.kv_heads * model.kv_channels
    per_token = param_bytes * (4 * h / x + (3 * q + 3 * k) / t) \
        + mlp_per_token(model, parallel, param_bytes)
    local = _local(seq, parallel)
    return math.ceil(rows * local * per_token) + attention_lse(model, parallel, rows, seq) \
        + rope_tables(model, local, param_bytes) \
        + gathered_kv(model, parallel, rows, seq, param_bytes)


def layer_input(model: ModelConfig, parallel: ParallelConfig, rows: int, seq: int,
                param_bytes: int) -> int:
    """Bytes of one layer's input for one micro-batch: all full recomputation keeps."""
    _, x = _shard(parallel)
    return math.ceil(rows * _local(seq, parallel) * model.hidden_size * param_bytes / x)


def kept_per_layer(model: ModelConfig, parallel: ParallelConfig, rows: int, seq: int,
                   param_bytes: int, recompute: str) -> int:
    """Bytes one layer keeps between its forward and its backward, for one micro-batch."""
    if recompute == "full":
        return layer_input(model, parallel, rows, seq, param_bytes)
    layer = layer_activations(model, parallel, rows, seq, param_bytes)
    if recompute == "selective":  # the core attention keeps its local inputs only
        return layer - attention_lse(model, parallel, rows, seq) \
            - gathered_kv(model, parallel, rows, seq, param_bytes)
    if recompute == "none":
        return layer
    raise ValueError(f"recompute must be one of {RECOMPUTE}, got {recompute!r}")


def rebuilt(model: ModelConfig, parallel: ParallelConfig, rows: int, seq: int,
            param_bytes: int, recompute: str) -> int:
    """Bytes recomputation rebuilds for the one layer being back-propagated: the whole
    layer (full), the core attention's LSE (selective: its output replaces the kept copy,
    which the output projection's backward has released), nothing (none)."""
    if recompute == "full":
        return layer_activations(model, parallel, rows, seq, param_bytes)
    if recompute == "selective":
        return attention_lse(model, parallel, rows, seq) \
            + gathered_kv(model, parallel, rows, seq, param_bytes)
    return 0


def layer_gradients(model: ModelConfig, parallel: ParallelConfig, rows: int, seq: int,
                    param_bytes: int) -> int:
    """Bytes of the largest gradient a layer's backward makes: the fused gate/up output's
    (an MoE layer's: of its routed tokens, at the assumed imbalance)."""
    t, x = _shard(parallel)
    tokens = rows * _local(seq, parallel)
    if model.is_moe:
        return math.ceil(tokens * MOE_IMBALANCE * model.moe_router_topk / x
                         * 2 * model.moe_ffn_hidden_size * param_bytes)
    return tokens * 2 * model.ffn_hidden_size // t * param_bytes


def backward_peak(model: ModelConfig, parallel: ParallelConfig, rows: int, seq: int,
                  param_bytes: int, *, recompute: str, logit_positions: int) -> int:
    """Bytes a backward adds to the kept activations at its peak: the last stage's logits
    workspace (`logit_positions` per row: lm_head_positions; 0 without an LM head), or
    later, once those are freed, the layer being back-propagated: what recomputation
    rebuilds of it and its gradients."""
    layer = rebuilt(model, parallel, rows, seq, param_bytes, recompute) \
        + layer_gradients(model, parallel, rows, seq, param_bytes)
    return max(layer, lm_logits(model, parallel.tensor_parallel, rows, logit_positions,
                                param_bytes))


def lm_head_positions(parallel: ParallelConfig, seq: int, new_tokens: int,
                      full_seq: int) -> int:
    """Positions of a micro-batch row (`seq` long) at which a policy's LM head runs on this
    rank: under context parallelism all of its s/c; at CP1 only those before response tokens
    (engine/schedule.py): at full length new_tokens of every full_seq (prompt + response)
    positions."""
    if parallel.context_parallel > 1:
        return _local(seq, parallel)
    return -(-seq * new_tokens // full_seq)


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
                      seq: int, microbatches: int, param_bytes: int,
                      recompute: str = "none") -> int:
    """Peak bytes of activations kept for backward on pipeline rank `pp_rank`, with
    `recompute` one of RECOMPUTE (what a backward adds on top: backward_peak)."""
    held = in_flight_layers(model, parallel, pp_rank, microbatches)
    # A micro-batch's mask is shared by its chunks: at most one per forward in flight.
    masks = min(microbatches, forwards_in_flight(parallel, pp_rank, microbatches)) \
        * rows * _local(seq, parallel) * seq
    kept = held * kept_per_layer(model, parallel, rows, seq, param_bytes, recompute) + masks
    if pp_rank == parallel.pipeline_parallel - 1:
        # The final norm's input and output (the output layer's or value head's input).
        kept += 2 * layer_input(model, parallel, rows, seq, param_bytes)
    return kept


def lm_logits(model: ModelConfig, tp: int, rows: int, seq: int, param_bytes: int, *,
              backward: bool = True) -> int:
    """Peak bytes of one micro-batch's vocab-parallel logits and their fp32 workspace (the
    whole sequence, with or without sequence parallelism), in training (`backward`) or in a
    forward-only pass."""
    fp32 = FP32_BYTES
    forward = param_bytes + 2 * fp32 + (fp32 if param_bytes < fp32 else 0)
    per_entry = max(forward, 2 * param_bytes + 2 * fp32) if backward else forward
    return rows * seq * (model.padded_vocab_size(tp) // tp) * per_entry


def forward_pass(model: ModelConfig, parallel: ParallelConfig, rows: int, seq: int,
                 param_bytes: int, *, logit_positions: int) -> int:
    """Peak bytes of a forward-only pass over one micro-batch: one layer's tensors at a time
    (none is kept), or on the last stage of an LM its logits at `logit_positions` per row
    (lm_head_positions; 0 without an LM head), whichever is larger."""
    layer = layer_activations(model, parallel, rows, seq, param_bytes)
    return max(layer, lm_logits(model, parallel.tensor_parallel, rows, logit_positions,
                                param_bytes, backward=False))


def inference_layer(model: ModelConfig, tp: int, rows: int, seq: int, param_bytes: int) -> int:
    """Peak bytes of one layer of a no-grad forward (generation's prefill): nothing is kept
    for a backward, so only the widest point is alive at once, the MLP of a Llama layer:
    the residual stream and the norm's output (2h), gate and up (2f/t) and SwiGLU's output
    (f/t), per token."""
    h, f = model.hidden_size, model.ffn_hidden_size
    if model.is_moe:  # every token's k experts (an engine's experts are all on its ranks)
        return rows * seq * param_bytes * (2 * h + model.moe_router_topk
                                           * (h + 3 * model.moe_ffn_hidden_size // tp))
    return rows * seq * param_bytes * (2 * h + 3 * f // tp)


def kv_cache(model: ModelConfig, tp: int, rows: int, seq: int, param_bytes: int) -> int:
    """Bytes of keys and values of every layer for `rows` sequences of `seq` tokens."""
    return 2 * model.num_layers * rows * seq * model.kv_heads // tp * model.kv_channels \
        * param_bytes


def largest_tensor(model: ModelConfig, tp: int) -> int:
    """Elements of the largest single Megatron tensor in its full (TP-gathered) form: the
    padded embedding / output layer, or a layer's fused QKV, fused gate/up, output or down
    projection (an MoE layer's: one expert's, or the router)."""
    h = model.hidden_size
    f = model.moe_ffn_hidden_size if model.is_moe else model.ffn_hidden_size
    q = model.num_attention_heads * model.kv_channels
    k = model.kv_heads * model.kv_channels
    return max(model.padded_vocab_size(tp) * h, (q + 2 * k) * h, 2 * f * h, q * h, f * h,
               (model.num_experts or 0) * h)


def largest_projection(model: ModelConfig) -> int:
    """Elements of the largest HF projection of a dense layer (q, k, v, o, gate, up, down):
    what the bridge merges a LoRA adapter into, one at a time."""
    h, f = model.hidden_size, model.ffn_hidden_size
    return max(model.num_attention_heads * model.kv_channels * h, f * h)


def largest_bucket(model: ModelConfig, tp: int, *, lm_params: int, rollout_bytes: int,
                   bucket_bytes: int) -> int:
    """Bound on the bytes of the bridge's largest bucket: bucket_bytes, or the largest
    single tensor when bigger, never more than the whole model (`lm_params` at TP1), in the
    rollout dtype."""
    largest = largest_tensor(model, tp) * rollout_bytes
    return min(max(bucket_bytes, largest), lm_params * rollout_bytes)


def sync_buffers(model: ModelConfig, parallel: ParallelConfig, *, lm_params: int,
                 param_bytes: int, rollout_bytes: int, bucket_bytes: int,
                 lora: bool = False) -> int:
    """Bound on the bytes one training rank of the actor (at `parallel`) allocates while
    streaming its weights to the rollout engines (rollout.bridge): the largest bucket, and
    the TP all-gather, assembly and split of the largest tensor in the training dtype
    (BridgePlan.peak_extra_bytes). At TP1 without pipeline stages the engines get views of
    the parameters: no bucket is assembled (with LoRA the merged tensors are new ones). With
    LoRA, the merge of the largest projection: an fp32 copy and its result."""
    tp = parallel.tensor_parallel
    # Experts held by other EP ranks arrive as fresh copies, bucketed like any tensor.
    whole = tp == 1 and parallel.pipeline_parallel == 1 and parallel.expert_parallel == 1 \
        and not lora
    bucket = 0 if whole else largest_bucket(model, tp, lm_params=lm_params,
                                            rollout_bytes=rollout_bytes,
                                            bucket_bytes=bucket_bytes)
    merge = largest_projection(model) * (FP32_BYTES + param_bytes) if lora else 0
    return bucket + 3 * largest_tensor(model, tp) * param_bytes + merge
