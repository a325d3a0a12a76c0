"""Per-token log-probabilities and entropy from vocabulary-sharded logits, without gathering.

Legend: B batch, T time, V/tp this rank's vocabulary slice [tp_rank*V/tp, (tp_rank+1)*V/tp).
z are the logits, m the max of z over the FULL vocabulary, s = z - m, S = sum_v exp(s_v).

    log p(y) = s_y - log S
    H        = -sum_v p_v log p_v = log S - (sum_v exp(s_v) s_v) / S

m is all-reduced across TP (MAX); S, s_y (contributed by the one rank whose slice holds y) and
sum_v exp(s_v) s_v are partial sums all-reduced together in ONE SUM, so the fused
logprobs + entropy costs the same two collectives as logprobs alone. Memory is O(B*T*V/tp);
the gradients are formed locally from the saved softmax:

    dlog p(y)/dz_v = onehot(y)_v - p_v          dH/dz_v = p_v (E_p[z] - z_v)

Rows of the embedding added to pad the vocabulary for TP (ids >= vocab_size) are excluded from
the softmax, as in the HF model and the rollout engine, which have no such rows; otherwise the
result would depend on the TP size. With sizeable padding, the last rank's slice may hold no
real id at all.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _real_width(vocab_start: int, vocab_size: int, width: int) -> int:
    """How many leading columns of this rank's slice are real (not padding) vocabulary ids."""
    return min(max(vocab_size - vocab_start, 0), width)


def _shifted_exp(logits_BTV: torch.Tensor, n_real: int, group):
    """(m_BT, s_BTV, exp(s)_BTV) in fp32, with padding columns at s = -inf (exp 0)."""
    z = logits_BTV.float()
    if n_real > 0:
        m_BT = z[..., :n_real].amax(dim=-1)
    else:  # this slice is all padding; other ranks supply the max
        m_BT = z.new_full(z.shape[:-1], float("-inf"))
    m_BT = _all_reduce(m_BT, dist.ReduceOp.MAX, group)
    s_BTV = z - m_BT.unsqueeze(-1)  # a new tensor: the caller's logits are never written
    s_BTV[..., n_real:] = float("-inf")
    return m_BT, s_BTV, torch.exp(s_BTV)


def _local_labels(labels_BT: torch.Tensor, vocab_start: int, width: int):
    """Labels as column indices into this slice (0 where not here) and where they are here."""
    local = labels_BT - vocab_start
    in_slice = (local >= 0) & (local < width)
    return torch.where(in_slice, local, torch.zeros_like(local)), in_slice


class _VocabParallelSoftmax(torch.autograd.Function):
    """Returns (logp_BT,), (entropy_BT,) or (logp_BT, entropy_BT): whichever was asked for."""

    @staticmethod
    def forward(ctx, logits_BTV, labels_BT, with_entropy, vocab_start, vocab_size, group):
        ctx.set_materialize_grads(False)  # skip the entropy term when only logp is used
        width = logits_BTV.shape[-1]
        m_BT, s_BTV, exp_BTV = _shifted_exp(
            logits_BTV, _real_width(vocab_start, vocab_size, width), group)

        partial = [exp_BTV.sum(dim=-1)]
        local = in_slice = None
        if labels_BT is not None:
            local, in_slice = _local_labels(labels_BT, vocab_start, width)
            s_y = torch.gather(s_BTV, -1, local.unsqueeze(-1)).squeeze(-1)
            partial.append(torch.where(in_slice, s_y, 0.0))
        if with_entropy:
            # exp(s) * s at s = -inf (padding, or logits masked to -inf) is 0 * -inf = nan;
            # its limit is 0. A nan logit still shows, through S.
            partial.append(s_BTV.mul_(exp_BTV).nan_to_num_(nan=0.0).sum(dim=-1))
        del s_BTV
        sums = _all_reduce(torch.stack(partial), dist.ReduceOp.SUM, group)
        sumexp_BT = sums[0]
        log_sumexp_BT = torch.log(sumexp_BT)

        outputs = []
        if labels_BT is not None:
            outputs.append(sums[1] - log_sumexp_BT)
        mean_logit_BT = None
        if with_entropy:
            mean_shifted_BT = sums[-1] / sumexp_BT  # E_p[s] <= 0
            outputs.append(log_sumexp_BT - mean_shifted_BT)
            mean_logit_BT = m_BT + mean_shifted_BT  # E_p[z], for the gradient
        softmax_BTV = exp_BTV.div_(sumexp_BT.unsqueeze(-1))
        # The entropy gradient needs z: keep the caller's tensor (no copy) rather than s.
        ctx.save_for_backward(softmax_BTV, local, in_slice,
                              logits_BTV if with_entropy else None, mean_logit_BT)
        ctx.with_logp = labels_BT is not None
        ctx.input_dtype = logits_BTV.dtype
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        softmax_BTV, local, in_slice, logits_BTV, mean_logit_BT = ctx.saved_tensors
        grad_logp_BT = grads[0] if ctx.with_logp else None
        grad_entropy_BT = grads[-1] if logits_BTV is not None else None
        if grad_logp_BT is None and grad_entropy_BT is None:
            return None, None, None, None, None, None

        if grad_entropy_BT is not None:
            # p_v * (g_H (E_p[z] - z_v) - g_logp); padding has p = 0 and finite z, so 0.
            # fp32 like the forward, without an fp32 copy of bf16 logits first.
            grad_BTV = torch.sub(mean_logit_BT.unsqueeze(-1), logits_BTV,
                                 out=torch.empty_like(softmax_BTV))
            grad_BTV.mul_(grad_entropy_BT.unsqueeze(-1))
            if grad_logp_BT is not None:
                grad_BTV.sub_(grad_logp_BT.unsqueeze(-1))
            grad_BTV.mul_(softmax_BTV).nan_to_num_(nan=0.0)  # z = -inf where p = 0
        else:
            grad_BTV = softmax_BTV.mul_(-grad_logp_BT.unsqueeze(-1))  # saved softmax reused
        if grad_logp_BT is not None:
            hit = (grad_logp_BT * in_slice).unsqueeze(-1)
            grad_BTV.scatter_add_(-1, local.unsqueeze(-1), hit)
        return grad_BTV.to(ctx.input_dtype), None, None, None, None, None


def _check(logits_BTV: torch.Tensor, labels_BT: torch.Tensor | None, vocab_start: int,
           vocab_size: int) -> None:
    if vocab_size < 1 or vocab_start < 0:
        raise ValueError(f"need vocab_size >= 1 and vocab_start >= 0, got vocab_size="
                         f"{vocab_size}, vocab_start={vocab_start}")
    if labels_BT is None:
        return
    if logits_BTV.shape[:-1] != labels_BT.shape:
        raise ValueError(
            f"logits {tuple(logits_BTV.shape)} and labels {tuple(labels_BT.shape)} disagree on "
            f"the leading dimensions"
        )
    if labels_BT.numel() and int(labels_BT.max()) >= vocab_size:
        raise ValueError(f"label id {int(labels_BT.max())} is outside the vocabulary "
                         f"(size {vocab_size})")


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
    _check(logits_BTV, labels_BT, vocab_start, vocab_size)
    (logp_BT,) = _VocabParallelSoftmax.apply(logits_BTV, labels_BT, False, vocab_start,
                                             vocab_size, tp_group)
    return logp_BT


def vocab_parallel_entropy(
    logits_BTV: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None,
    vocab_start: int,
    vocab_size: int,
) -> torch.Tensor:
    """Entropy of the softmax over the full (unpadded) vocabulary in fp32, [B, T].

    H = log S - sum_v exp(s_v) s_v / S (module docstring); differentiable w.r.t. the logits.
    Arguments as for `vocab_parallel_logprobs`. Rounding can leave a near-one-hot
    distribution at a tiny negative value (~1e-7); it is not clamped.
    """
    _check(logits_BTV, None, vocab_start, vocab_size)
    (entropy_BT,) = _VocabParallelSoftmax.apply(logits_BTV, None, True, vocab_start,
                                                vocab_size, tp_group)
    return entropy_BT


def vocab_parallel_logprobs_and_entropy(
    logits_BTV: torch.Tensor,
    labels_BT: torch.Tensor,
    *,
    tp_group: dist.ProcessGroup | None,
    vocab_start: int,
    vocab_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(labels), entropy), both fp32 [B, T], with one pass and two collectives.

    Cheaper than the two separate calls (one exp over the slice, one MAX and one SUM
    all-reduce instead of two each); the PPO actor loss needs both.
    """
    _check(logits_BTV, labels_BT, vocab_start, vocab_size)
    logp_BT, entropy_BT = _VocabParallelSoftmax.apply(logits_BTV, labels_BT, True, vocab_start,
                                                      vocab_size, tp_group)
    return logp_BT, entropy_BT
