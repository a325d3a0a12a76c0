"""Per-token log-probabilities from vocabulary-sharded logits, without gathering the vocabulary.

Legend: B batch, T time, V/tp this rank's vocabulary slice [tp_rank*V/tp, (tp_rank+1)*V/tp).

log p(y) = z_y - m - log sum_v exp(z_v - m), with m the global max (all-reduce MAX), the sum
all-reduced across TP (SUM), and z_y contributed by the one rank whose slice holds y. Memory is
O(B*T*V/tp); the gradient dlogp/dz = onehot(y) - softmax(z) is formed locally.

Rows of the embedding added to pad the vocabulary for TP (ids >= vocab_size) are excluded from
the softmax, as in the HF model and the rollout engine, which have no such rows; otherwise the
result would depend on the TP size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _VocabParallelLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits_BTV, labels_BT, vocab_start, vocab_size, group):
        logits = logits_BTV.float()
        n_real = vocab_size - vocab_start
        if n_real < logits.shape[-1]:
            logits = logits.clone()
            logits[..., max(n_real, 0):] = float("-inf")
        m_BT = _all_reduce(logits.max(dim=-1).values, dist.ReduceOp.MAX, group)
        exp_BTV = torch.exp(logits - m_BT.unsqueeze(-1))
        sumexp_BT = _all_reduce(exp_BTV.sum(dim=-1), dist.ReduceOp.SUM, group)

        local = labels_BT - vocab_start
        in_slice = (local >= 0) & (local < logits.shape[-1])
        local = torch.where(in_slice, local, torch.zeros_like(local))
        target_BT = torch.gather(logits, -1, local.unsqueeze(-1)).squeeze(-1)
        target_BT = _all_reduce(torch.where(in_slice, target_BT, 0.0), dist.ReduceOp.SUM, group)

        logp_BT = target_BT - m_BT - torch.log(sumexp_BT)
        exp_BTV.div_(sumexp_BT.unsqueeze(-1))  # now the softmax, kept for backward
        ctx.save_for_backward(exp_BTV, local, in_slice)
        ctx.input_dtype = logits_BTV.dtype
        return logp_BT

    @staticmethod
    def backward(ctx, grad_BT):
        softmax_BTV, local, in_slice = ctx.saved_tensors
        grad_BTV = softmax_BTV.mul_(-grad_BT.unsqueeze(-1))
        hit = (grad_BT * in_slice).unsqueeze(-1)
        grad_BTV.scatter_add_(-1, local.unsqueeze(-1), hit)
        return grad_BTV.to(ctx.input_dtype), None, None, None, None


def vocab_parallel_logprobs(
    logits_BTV: torch.Tensor,
    labels_BT: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None,
    vocab_start: int,
    vocab_size: int,
) -> torch.Tensor:
    """log p(labels) in fp32, [B, T], from this rank's slice of the logits (differentiable).

    `vocab_start` is the first vocabulary id of this rank's slice (tp_rank * V/tp);
    `vocab_size` the real (unpadded) vocabulary size.
    """
    if logits_BTV.shape[:-1] != labels_BT.shape:
        raise ValueError(
            f"logits {tuple(logits_BTV.shape)} and labels {tuple(labels_BT.shape)} disagree on "
            f"the leading dimensions"
        )
    if labels_BT.numel() and int(labels_BT.max()) >= vocab_size:
        raise ValueError(f"label id {int(labels_BT.max())} is outside the vocabulary "
                         f"(size {vocab_size})")
    return _VocabParallelLogprob.apply(logits_BTV, labels_BT, vocab_start, vocab_size, tp_group)
