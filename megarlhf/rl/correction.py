"""Rollout-mismatch correction: importance weights for samples drawn by the rollout engine.

The engine samples from its own distribution pi_engine (its kernels, its dtype), the trainer's
loss assumes pi_old (the trainer's logprobs of the same tokens before the update). Reweighting
by pi_old / pi_engine corrects the policy gradient for the gap; the weights are truncated (TIS,
Yao et al. 2025) or, outside a trust band, zeroed (MIS: masked importance sampling), since
untruncated ratios of a long sequence have unbounded variance.

Legend: B batch (sequences), T time (token positions); mask_BT is 1 on response tokens.
"""

from __future__ import annotations

import math

import torch

from megarlhf.rl.kl import check_same_shape

CORRECTIONS = ("none", "tis", "mis")
"""rollout_correction values; not "off", which YAML reads as false."""
CORRECTION_LEVELS = ("token", "sequence")
_LOG_RATIO_CAP = 50.0
"""Log-ratios above this read as exp(50) in the statistics (a float guard; any threshold a
run uses is far below)."""


@torch.no_grad()
def rollout_correction(old_logp_BT: torch.Tensor, engine_logp_BT: torch.Tensor,
                       mask_BT: torch.Tensor, *, mode: str, level: str, high: float,
                       low: float | None = None
                       ) -> tuple[torch.Tensor, dict[str, float]]:
    """(weights_BT, stats): per-token weights for the policy-gradient loss, 0 where masked.

        token     w_t = exp(old_logp_t - engine_logp_t)
        sequence  w_i = exp(sum over the row's tokens of (old_logp - engine_logp)), on
                  every token of row i
        tis       w <- min(w, high)
        mis       w <- w where low <= w <= high, else 0       (low defaults to 1 / high)
    stats, over tokens (token level) or rows (sequence level), before truncation / masking:
        rollout/is_ratio_mean, rollout/is_ratio_max, and rollout/is_clipped_frac (the share
        truncated or masked).
    """
    check_same_shape(old_logp=old_logp_BT, engine_logp=engine_logp_BT, mask=mask_BT)
    if mode not in CORRECTIONS[1:] or level not in CORRECTION_LEVELS:
        raise ValueError(f"mode must be one of {CORRECTIONS[1:]} and level one of "
                         f"{CORRECTION_LEVELS}, got {mode!r}, {level!r}")
    low = 1.0 / high if low is None else low
    if not 0 <= low < 1 < high:
        raise ValueError(f"need 0 <= low < 1 < high, got low={low}, high={high}")
    mask = mask_BT.bool()
    log_w_BT = torch.where(mask, old_logp_BT.double() - engine_logp_BT.double(), 0.0)
    if level == "token":
        log_w, counted = log_w_BT, mask
    else:
        log_w, counted = log_w_BT.sum(dim=-1), mask.any(dim=-1)
    log_w = log_w.clamp(max=_LOG_RATIO_CAP)
    w = torch.exp(log_w)
    if mode == "tis":
        changed = w > high
        weights = w.clamp(max=high)
    else:
        changed = (w > high) | (log_w < (math.log(low) if low > 0 else -math.inf))
        weights = torch.where(changed, 0.0, w)
    if level == "sequence":
        weights = weights.unsqueeze(-1).expand_as(log_w_BT)
    n = counted.sum().clamp(min=1)
    stats = {"rollout/is_ratio_mean": float(w[counted].sum() / n),
             "rollout/is_ratio_max": float(w[counted].max()) if counted.any() else 0.0,
             "rollout/is_clipped_frac": float((changed & counted).sum() / n)}
    return torch.where(mask, weights, 0.0).to(old_logp_BT.dtype), stats
