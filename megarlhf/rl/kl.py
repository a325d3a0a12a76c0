"""KL penalty estimators, KL-shaped token rewards, and the KL coefficient controllers.

Legend: B batch (sequences), T time (token positions). logp_BT are the policy's log-probs of
the sampled tokens, ref_logp_BT the reference model's; mask_BT is 1 (or True) on response
tokens, 0 elsewhere (prompt, padding). Masks are 0/1, bool or numeric.

This module also holds the shape checks the other `megarlhf.rl` modules share.
"""

from __future__ import annotations

import torch


def check_same_shape(**tensors: torch.Tensor) -> None:
    """Raise ValueError naming every tensor and its shape unless all shapes are equal."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        described = ", ".join(f"{name} {shape}" for name, shape in shapes.items())
        raise ValueError(f"shapes disagree: {described}; all must be [batch, time]")


def check_rows(score_B: torch.Tensor, mask_BT: torch.Tensor) -> None:
    """Raise ValueError unless score_B is [B] for a [B, T] mask."""
    if score_B.dim() != 1 or mask_BT.dim() != 2 or score_B.shape[0] != mask_BT.shape[0]:
        raise ValueError(f"scores {tuple(score_B.shape)} must be [B] for a mask "
                         f"{tuple(mask_BT.shape)} of [B, T]")


def last_token_index(mask_BT: torch.Tensor) -> torch.Tensor:
    """[B] index of each row's last response token; ValueError for a row without one."""
    has_token = mask_BT.bool().any(dim=-1)
    if not bool(has_token.all()):
        rows = torch.nonzero(~has_token).flatten().tolist()
        raise ValueError(f"rows {rows} have no response token (mask all 0); drop them or give "
                         f"each at least one")
    positions = torch.arange(mask_BT.shape[-1], device=mask_BT.device)
    # positions are increasing, so the largest masked position is the unique argmax.
    return torch.where(mask_BT.bool(), positions, -1).argmax(dim=-1)


def _k1(log_ratio):
    return log_ratio


def _k2(log_ratio):
    return 0.5 * log_ratio.square()


def _k3(log_ratio):
    return torch.expm1(-log_ratio) + log_ratio  # exp(-x) - 1 + x, exact for small x


KL_ESTIMATORS = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_penalty(logp_BT: torch.Tensor, ref_logp_BT: torch.Tensor, kind: str, *,
               clamp: float | None = None) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from tokens sampled from pi (Schulman's k1/k2/k3).

    With x = logp - ref_logp:
        k1 = x                          unbiased, high variance, can be negative
        k2 = 0.5 * x^2                  biased, low variance, >= 0
        k3 = exp(-x) - (-x) - 1         unbiased, low variance, >= 0 (the "low_var_kl")
    With `clamp`, the estimate is clamped to [-clamp, clamp]: k3 grows as exp(-x), and one
    token the policy made far likelier than the reference would otherwise dominate a batch.
    """
    if kind not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; choose one of {sorted(KL_ESTIMATORS)}")
    check_same_shape(logp=logp_BT, ref_logp=ref_logp_BT)
    kl_BT = KL_ESTIMATORS[kind](logp_BT - ref_logp_BT)
    return kl_BT if clamp is None else kl_BT.clamp(-clamp, clamp)


def kl_shaped_rewards(
    score_B: torch.Tensor,
    logp_BT: torch.Tensor | None,
    ref_logp_BT: torch.Tensor | None,
    mask_BT: torch.Tensor,
    *,
    kl_coef: float,
    kind: str = "k1",
    clip_reward: float | None = None,
    kl_clamp: float | None = None,
) -> torch.Tensor:
    """Token rewards [B, T]: a KL penalty on every response token, the score on the last one.

        r_t = -kl_coef * kl_t                      for response tokens t (mask 1)
                                                   (kl_t = kl_penalty(..., clamp=kl_clamp))
        r_last += clip(score, -clip_reward, clip_reward)  (no clipping when clip_reward is None)
        r_t = 0                                    elsewhere

    as in DeepSpeed-Chat's `compute_rewards`; `last` is each row's last response token.
    With kl_coef 0 the logprobs are not read and may be None.
    """
    check_rows(score_B, mask_BT)
    if clip_reward is not None and clip_reward <= 0:
        raise ValueError(f"clip_reward must be > 0 or None, got {clip_reward}")
    if logp_BT is None or ref_logp_BT is None:
        if kl_coef != 0:
            raise ValueError(f"kl_coef={kl_coef} needs logp_BT and ref_logp_BT")
        rewards_BT = torch.zeros(mask_BT.shape, dtype=torch.float32, device=mask_BT.device)
    else:
        check_same_shape(logp=logp_BT, ref_logp=ref_logp_BT, mask=mask_BT)
        kl_BT = kl_penalty(logp_BT, ref_logp_BT, kind, clamp=kl_clamp)
        rewards_BT = torch.where(mask_BT.bool(), -kl_coef * kl_BT, 0.0)
    if clip_reward is not None:
        score_B = score_B.clamp(-clip_reward, clip_reward)
    last_B = last_token_index(mask_BT)
    return rewards_BT.scatter_add(-1, last_B.unsqueeze(-1),
                                  score_B.to(rewards_BT.dtype).unsqueeze(-1))


class FixedKLController:
    """A constant KL coefficient, with the same interface as `AdaptiveKLController`."""

    def __init__(self, value: float):
        if value < 0:
            raise ValueError(f"KL coefficient must be >= 0, got {value}")
        self.value = float(value)

    def update(self, current_kl: float, n_steps: int) -> None:
        """Does nothing: the coefficient is fixed."""

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        """Checks the state's form and keeps the configured coefficient: a fixed one is
        config, not state (a resumed run takes the value its config gives now)."""
        _load_value(state)


class AdaptiveKLController:
    """Ziegler et al. (2019): steer the observed KL towards `target` over `horizon` samples.

        err   = clip(current_kl / target - 1, -0.2, 0.2)
        value = value * (1 + err * n_steps / horizon)

    `n_steps` is the number of samples (sequences) the KL was measured on since the last
    update. Only `value` changes over time, and it is the whole state: `state_dict()` holds it
    as a Python float, so a resumed run continues with bit-identical coefficients.
    """

    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        if init_kl_coef <= 0 or target <= 0 or horizon <= 0:
            raise ValueError(f"init_kl_coef, target and horizon must all be > 0, got "
                             f"{init_kl_coef}, {target}, {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        err = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + err * n_steps / self.horizon

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = _load_value(state)


def _load_value(state: dict) -> float:
    if set(state) != {"value"}:
        raise ValueError(f"KL controller state must have exactly the key 'value', got "
                         f"{sorted(state)}")
    return float(state["value"])
