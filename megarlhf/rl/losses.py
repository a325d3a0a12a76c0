"""PPO policy and value losses per token, and how per-token losses become one batch loss.

Legend: B batch (sequences), T time (token positions). mask_BT is 1 (or True) on the tokens
that count (response tokens), 0 elsewhere. Per-token outputs are 0 where the mask is 0;
masked positions must still hold finite numbers (a nan there would reach the gradient).

Aggregation contract. `aggregate` returns a (numerator, denominator) pair per micro-batch
instead of a mean. The loss of a global batch is

    loss = sum over all micro-batches and DP ranks of numerator
           / sum over all micro-batches and DP ranks of denominator

so loss and gradient do not depend on how the batch is cut into micro-batches and ranks
(a mean of per-micro-batch means would weight a short micro-batch's tokens more). This is the
engine's loss-closure contract `(loss_sum, num_tokens, metrics)`: megatron-core's
`calculate_per_token_loss` sums both parts over micro-batches and DP and divides once.
"""

from __future__ import annotations

import torch

from megarlhf.rl.kl import check_same_shape


def policy_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    clip_eps: float,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate per token; returns (loss_BT, stats).

        ratio = exp(logp - old_logp)
        loss  = max(-A * ratio, -A * clip(ratio, 1 - clip_eps, 1 + clip_eps_high))
    clip_eps_high defaults to clip_eps (a larger one is DAPO's "clip-higher"). Dual clip
    (Ye et al. 2020), for A < 0 only, caps the loss of a ratio far above 1:
        loss  = min(loss, -dual_clip * A)          dual_clip > 1
    stats (detached, [B, T], 0 where masked):
        clipped       1.0 where the clipped term was taken (for the clip fraction)
        dual_clipped  1.0 where the dual-clip cap was taken
        approx_kl     k3 estimate of KL(pi_old || pi): ratio - 1 - log(ratio), >= 0,
                      unbiased because the tokens were sampled from pi_old
    """
    check_same_shape(logp=logp_BT, old_logp=old_logp_BT, advantages=advantages_BT,
                     mask=mask_BT)
    if clip_eps_high is None:
        clip_eps_high = clip_eps
    if not 0 < clip_eps < 1 or clip_eps_high <= 0:
        raise ValueError(f"need 0 < clip_eps < 1 and clip_eps_high > 0, got clip_eps="
                         f"{clip_eps}, clip_eps_high={clip_eps_high}")
    if dual_clip is not None and dual_clip <= 1:
        raise ValueError(f"dual_clip must be > 1 (it caps the loss at dual_clip * |A| for "
                         f"A < 0), got {dual_clip}; use None to disable it")
    mask = mask_BT.bool()
    log_ratio_BT = logp_BT - old_logp_BT
    ratio_BT = torch.exp(log_ratio_BT)
    unclipped_BT = -advantages_BT * ratio_BT
    clipped_BT = -advantages_BT * ratio_BT.clamp(1 - clip_eps, 1 + clip_eps_high)
    loss_BT = torch.maximum(unclipped_BT, clipped_BT)
    dual_BT = torch.zeros_like(mask)
    if dual_clip is not None:
        cap_BT = -dual_clip * advantages_BT
        dual_BT = (advantages_BT < 0) & (cap_BT < loss_BT)
        loss_BT = torch.where(dual_BT, cap_BT, loss_BT)
    with torch.no_grad():
        stats = {
            "clipped": ((clipped_BT > unclipped_BT) & mask).to(logp_BT.dtype),
            "dual_clipped": (dual_BT & mask).to(logp_BT.dtype),
            "approx_kl": torch.where(mask, torch.expm1(log_ratio_BT) - log_ratio_BT, 0.0),
        }
    return torch.where(mask, loss_BT, 0.0), stats


def value_loss(
    values_BT: torch.Tensor,
    old_values_BT: torch.Tensor,
    returns_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    clip_eps: float | None,
) -> torch.Tensor:
    """Clipped value loss per token [B, T] (PPO2 / DeepSpeed-Chat `critic_loss_fn`).

        v_clip = clip(v, old_v - clip_eps, old_v + clip_eps)
        loss   = 0.5 * max((v - R)^2, (v_clip - R)^2)
    clip_eps=None gives the unclipped 0.5 * (v - R)^2.
    """
    check_same_shape(values=values_BT, old_values=old_values_BT, returns=returns_BT,
                     mask=mask_BT)
    if clip_eps is not None and clip_eps <= 0:
        raise ValueError(f"clip_eps must be > 0 or None (unclipped), got {clip_eps}")
    loss_BT = (values_BT - returns_BT).square()
    if clip_eps is not None:
        clipped_BT = torch.clamp(values_BT, old_values_BT - clip_eps, old_values_BT + clip_eps)
        loss_BT = torch.maximum(loss_BT, (clipped_BT - returns_BT).square())
    return torch.where(mask_BT.bool(), 0.5 * loss_BT, 0.0)


AGGREGATION_MODES = ("token_mean", "seq_mean_token_mean")


def aggregate(loss_BT: torch.Tensor, mask_BT: torch.Tensor,
              mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(numerator, denominator), 0-dim, for the global-batch loss sum(num) / sum(den).

        token_mean           num = sum of masked losses,     den = number of masked tokens
        seq_mean_token_mean  num = sum over rows of the row's masked mean loss,
                             den = number of rows with at least one masked token
    The denominator is an int64 count (the engine's `num_tokens`). See the module docstring
    for why a pair and not a mean.
    """
    check_same_shape(loss=loss_BT, mask=mask_BT)
    mask = mask_BT.bool()
    masked_BT = torch.where(mask, loss_BT, 0.0)
    if mode == "token_mean":
        return masked_BT.sum(), mask.sum()
    if mode == "seq_mean_token_mean":
        tokens_B = mask.sum(dim=-1)
        row_mean_B = masked_BT.sum(dim=-1) / tokens_B.clamp(min=1)
        return row_mean_B.sum(), (tokens_B > 0).sum()
    raise ValueError(f"unknown aggregation mode {mode!r}; choose one of {AGGREGATION_MODES}")


def entropy_bonus(entropy_BT: torch.Tensor, mask_BT: torch.Tensor, *, coef: float,
                  mode: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(numerator, denominator) of the entropy bonus term -coef * H, as `aggregate`.

    Add the numerator to the policy loss's numerator when both use the same mode and mask.
    """
    return aggregate(-coef * entropy_BT, mask_BT, mode)
