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


RATIO_LEVELS = ("token", "sequence")
POLICY_LOSSES = ("clip", "cispo")


def policy_loss(
    logp_BT: torch.Tensor,
    old_logp_BT: torch.Tensor,
    advantages_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    clip_eps: float,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    ratio_level: str = "token",
    kind: str = "clip",
    log_ratio_clamp: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy-gradient loss per token; returns (loss_BT, stats).

    The importance ratio of token t, r = exp(x), with the log-ratio x:
        token     x_t = logp_t - old_logp_t
        sequence  x_t = mean over the row's tokens of (logp - old_logp), its value for every
                  token, its gradient that of logp_t (GSPO, Zheng et al. 2025, in the
                  "GSPO-token" form: x_t = logp_t - sg(logp_t) + sg(mean(logp - old_logp)),
                  the sequence objective's gradient whenever a row's advantages are equal)
    x is clamped to [-log_ratio_clamp, log_ratio_clamp] first when given (an overflow guard
    for tokens whose probability moved by orders of magnitude).

    kind 'clip' (PPO):
        loss = max(-A * r, -A * clip(r, 1 - clip_eps, 1 + clip_eps_high))
      dual clip (Ye et al. 2020), for A < 0 only, caps the loss of a ratio far above 1:
        loss = min(loss, -dual_clip * A)          dual_clip > 1
    kind 'cispo' (MiniMax-M1, 2025): the ratio, clipped and without gradient, weights the
    REINFORCE term, so a clipped token still gets a gradient:
        loss = -A * sg(clip(r, 1 - clip_eps, 1 + clip_eps_high)) * exp(logp - sg(logp))
      (value -A * clipped r; gradient -A * clipped r * grad logp).
    clip_eps_high defaults to clip_eps (a larger one is DAPO's "clip-higher").
    stats (detached, [B, T], 0 where masked):
        clipped       1.0 where clipping changed the loss (clip) or the weight (cispo)
        dual_clipped  1.0 where the dual-clip cap was taken
        approx_kl     k3 estimate of KL(pi_old || pi) per token: r - 1 - log(r) of the
                      token ratio, >= 0, unbiased because the tokens were sampled from pi_old
    """
    check_same_shape(logp=logp_BT, old_logp=old_logp_BT, advantages=advantages_BT,
                     mask=mask_BT)
    if clip_eps_high is None:
        clip_eps_high = clip_eps
    if not 0 < clip_eps <= 1 or clip_eps_high <= 0:  # 1: no lower bound (CISPO's choice)
        raise ValueError(f"need 0 < clip_eps <= 1 and clip_eps_high > 0, got clip_eps="
                         f"{clip_eps}, clip_eps_high={clip_eps_high}")
    if dual_clip is not None and (dual_clip <= 1 or kind != "clip"):
        raise ValueError(f"dual_clip must be > 1 (it caps the loss at dual_clip * |A| for "
                         f"A < 0) and needs kind 'clip', got {dual_clip} with {kind!r}; use "
                         f"None to disable it")
    if ratio_level not in RATIO_LEVELS or kind not in POLICY_LOSSES:
        raise ValueError(f"ratio_level must be one of {RATIO_LEVELS} and kind one of "
                         f"{POLICY_LOSSES}, got {ratio_level!r}, {kind!r}")
    mask = mask_BT.bool()
    token_log_ratio_BT = torch.where(mask, logp_BT - old_logp_BT, 0.0)
    if ratio_level == "token":
        log_ratio_BT = token_log_ratio_BT
    else:
        seq_B = token_log_ratio_BT.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)
        log_ratio_BT = logp_BT - logp_BT.detach() + seq_B.detach().unsqueeze(-1)
    if log_ratio_clamp is not None:
        log_ratio_BT = log_ratio_BT.clamp(-log_ratio_clamp, log_ratio_clamp)
    ratio_BT = torch.exp(log_ratio_BT)
    bounded_BT = ratio_BT.clamp(1 - clip_eps, 1 + clip_eps_high)
    dual_BT = torch.zeros_like(mask)
    if kind == "cispo":
        loss_BT = -advantages_BT * bounded_BT.detach() * torch.exp(logp_BT - logp_BT.detach())
        clipped_BT = bounded_BT != ratio_BT
    else:
        unclipped_BT = -advantages_BT * ratio_BT
        clipped_loss_BT = -advantages_BT * bounded_BT
        loss_BT = torch.maximum(unclipped_BT, clipped_loss_BT)
        clipped_BT = clipped_loss_BT > unclipped_BT
        if dual_clip is not None:
            cap_BT = -dual_clip * advantages_BT
            dual_BT = (advantages_BT < 0) & (cap_BT < loss_BT)
            loss_BT = torch.where(dual_BT, cap_BT, loss_BT)
    with torch.no_grad():
        stats = {
            "clipped": (clipped_BT & mask).to(logp_BT.dtype),
            "dual_clipped": (dual_BT & mask).to(logp_BT.dtype),
            "approx_kl": torch.where(mask, torch.expm1(token_log_ratio_BT)
                                     - token_log_ratio_BT, 0.0),
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


AGGREGATION_MODES = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum",
                     "seq_mean_token_sum_norm")


def aggregate(loss_BT: torch.Tensor, mask_BT: torch.Tensor, mode: str, *,
              norm: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(numerator, denominator), 0-dim, for the global-batch loss sum(num) / sum(den).

        token_mean               num = sum of masked losses,   den = number of masked tokens
        seq_mean_token_mean      num = sum over rows of the row's masked mean loss,
                                 den = number of rows with at least one masked token
        seq_mean_token_sum       num = sum over rows of the row's masked loss sum, den = rows
        seq_mean_token_sum_norm  num = (the same) / norm, den = rows: Dr. GRPO's constant
                                 normaliser (norm, e.g. the generation budget in tokens) in
                                 place of each row's length, so a long answer is not
                                 down-weighted per token
    The denominator is an int64 count (the engine's `num_tokens`). See the module docstring
    for why a pair and not a mean.
    """
    check_same_shape(loss=loss_BT, mask=mask_BT)
    if (mode == "seq_mean_token_sum_norm") != (norm is not None):
        raise ValueError(f"norm (> 0) goes with seq_mean_token_sum_norm only; got mode "
                         f"{mode!r} and norm {norm}")
    mask = mask_BT.bool()
    masked_BT = torch.where(mask, loss_BT, 0.0)
    if mode == "token_mean":
        return masked_BT.sum(), mask.sum()
    tokens_B = mask.sum(dim=-1)
    rows = (tokens_B > 0).sum()
    if mode == "seq_mean_token_mean":
        return (masked_BT.sum(dim=-1) / tokens_B.clamp(min=1)).sum(), rows
    if mode == "seq_mean_token_sum":
        return masked_BT.sum(), rows
    if mode == "seq_mean_token_sum_norm":
        if norm <= 0:
            raise ValueError(f"norm must be > 0, got {norm}")
        return masked_BT.sum() / norm, rows
    raise ValueError(f"unknown aggregation mode {mode!r}; choose one of {AGGREGATION_MODES}")


def entropy_bonus(entropy_BT: torch.Tensor, mask_BT: torch.Tensor, *, coef: float,
                  mode: str, norm: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(numerator, denominator) of the entropy bonus term -coef * H, as `aggregate`.

    Add the numerator to the policy loss's numerator when both use the same mode and mask.
    """
    return aggregate(-coef * entropy_BT, mask_BT, mode, norm=norm)
