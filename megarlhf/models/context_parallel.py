"""Context parallelism (CP) without Transformer Engine: each of the CP ranks runs the model on
its share of every sequence, attention sees all keys through a gather over the CP group.

Chunking follows megatron-core's (its RoPE slicing, `get_pos_emb_on_this_cp_rank`, assumes
it): a sequence of length T is cut into 2 x CP equal chunks and rank r holds chunks r and
2 x CP - 1 - r, so every rank gets the same share of causal attention work (early chunks
attend to few keys, late chunks to many).

- `local_inputs`: a micro-batch's model inputs and labels for this CP rank (tokens, labels,
  positions, and the attention mask's rows of its queries over all key columns, made from the
  batch's document ids);
- `ContextParallelAttention`: core attention over this rank's queries and every rank's keys
  and values (gathered in sequence order; their gradients are summed back to the owners);
- `gather_sequence`: per-position outputs (engine/schedule.py: after the loss's own
  per-position step, an LM's log-probabilities rather than its logits) over the whole
  sequence on every CP rank. Every CP rank then computes the same loss from the same
  outputs, and its backward keeps only the gradient of its own positions, so the parameter gradients of the CP ranks
  add up to the gradient of the loss (megatron-core's DDP sums them over DP x CP).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.distributed as dist
from megatron.core.transformer.module import MegatronModule

from megarlhf.data.packing import document_mask
from megarlhf.parallel.mesh import Mesh


def positions(length: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The positions of the sequence [0, length) that CP rank `rank` holds, in its order."""
    if length % (2 * cp):
        raise ValueError(f"a sequence of {length} positions does not split into 2 x CP = "
                         f"{2 * cp} equal chunks; pad it to a multiple of {2 * cp}")
    chunk = length // (2 * cp)
    idx = torch.arange(length, device=device).view(2 * cp, chunk)
    return torch.cat([idx[rank], idx[2 * cp - 1 - rank]])


@functools.lru_cache(maxsize=64)
def _sequence_order(length: int, cp: int) -> torch.Tensor:
    """Where each position of the sequence sits among the CP ranks' parts laid rank after
    rank (a gather's order); cached: every layer's keys and values need it."""
    return torch.argsort(torch.cat([positions(length, cp, r) for r in range(cp)]))


def _gather(local: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The CP ranks' parts of a sequence along `dim`, put back in sequence order."""
    cp = dist.get_world_size(group)
    parts = [torch.empty_like(local) for _ in range(cp)]
    dist.all_gather(parts, local.contiguous(), group=group)
    stacked = torch.cat(parts, dim=dim)
    return stacked.index_select(dim, _sequence_order(stacked.shape[dim], cp).to(local.device))


class _GatherOutputs(torch.autograd.Function):
    """Forward: the whole sequence. Backward: this rank's positions of the gradient (every CP
    rank computes the same loss from the gathered tensor, so nothing is summed)."""

    @staticmethod
    def forward(ctx, local, dim, group):
        ctx.dim, ctx.group = dim, group
        return _gather(local, dim, group)

    @staticmethod
    def backward(ctx, grad):
        mine = positions(grad.shape[ctx.dim], dist.get_world_size(ctx.group),
                         dist.get_rank(ctx.group), grad.device)
        return grad.index_select(ctx.dim, mine), None, None


class _GatherKeys(torch.autograd.Function):
    """Forward: the whole sequence. Backward: the gradients every rank's queries put on the
    keys (values) summed over the CP ranks, this rank's positions of the sum."""

    @staticmethod
    def forward(ctx, local, dim, group):
        ctx.dim, ctx.group = dim, group
        return _gather(local, dim, group)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        mine = positions(grad.shape[ctx.dim], dist.get_world_size(ctx.group),
                         dist.get_rank(ctx.group), grad.device)
        return grad.index_select(ctx.dim, mine), None, None


def gather_sequence(local: torch.Tensor, dim: int, mesh: Mesh) -> torch.Tensor:
    """Per-position outputs of this CP rank (sequence along `dim`) -> the whole sequence."""
    if mesh.cp == 1:
        return local
    return _GatherOutputs.apply(local, dim, mesh.cp_group)


MODEL_LAYOUT = ("tokens", "labels", "position_ids", "routing")
"""A micro-batch's tensors laid out as the model's positions (the others may be in another
frame, roles/batching.py); `routing` is an expert routing to replay
(models/routing_replay.py)."""


def local_inputs(batch: dict, mesh: Mesh) -> dict:
    """The micro-batch's model-layout tensors (MODEL_LAYOUT, those it has) at this CP rank's
    positions, [B, T / CP], and from its `document_ids` the attention mask's rows of these
    queries, [B, 1, T / CP, T] (no document ids: no mask, the attention masks causally)."""
    T = batch["tokens"].shape[1]
    mine = None if mesh.cp == 1 else positions(T, mesh.cp, mesh.cp_rank, batch["tokens"].device)
    inputs = {k: batch[k] if mine is None else batch[k].index_select(1, mine)
              for k in MODEL_LAYOUT if k in batch}
    if "document_ids" in batch:
        inputs["attention_mask"] = document_mask(batch["document_ids"], mine,
                                                 batch.get("shared_prompt"))
    return inputs


class ContextParallelAttention(MegatronModule):
    """Core attention ([s/CP, b, heads, d] queries, keys, values in; [s/CP, b, heads*d] out)
    for CP > 1 over any core attention that accepts an explicit mask (megatron-core's local
    DotProductAttention, our SDPAttention): keys and values are gathered over the CP group,
    and the mask is [b, 1, s/CP, s] rows of this rank's queries (causal rows when None)."""

    def __init__(self, config, *, inner: type, **kwargs):
        super().__init__(config=config)
        from megatron.core import parallel_state as ps

        self.group = ps.get_context_parallel_group()
        # The inner attention computes one rank's rows of an ordinary attention: it must not
        # see CP (megatron-core's local attention refuses it).
        self.inner = inner(config=dataclasses.replace(config, context_parallel_size=1),
                           **kwargs)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if packed_seq_params is not None or attention_bias is not None:
            raise NotImplementedError("context parallelism here takes neither packed "
                                      "sequences nor an attention bias")
        key = _GatherKeys.apply(key, 0, self.group)
        value = _GatherKeys.apply(value, 0, self.group)
        if attention_mask is None:  # causal: the whole sequence is one document
            length = key.shape[0]
            mine = positions(length, dist.get_world_size(self.group),
                             dist.get_rank(self.group), query.device)
            one_document = torch.zeros(1, length, dtype=torch.long, device=query.device)
            attention_mask = document_mask(one_document, mine)
        return self.inner(query, key, value, attention_mask, attn_mask_type=attn_mask_type)
