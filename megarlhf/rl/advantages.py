"""Advantage estimators: GAE with a critic, and the critic-free GRPO, RLOO and REINFORCE++.

Legend: B batch (sequences), T time (token positions), G group size (samples per prompt).
mask_BT is 1 (or True) on response tokens, 0 elsewhere; it may start after prompt positions
and stop before right padding. Every [B, T] output is 0 where the mask is 0.

These are experience-making targets, not differentiated through: all run under no_grad.
Critic-free estimators share one calling convention, `fn(score_B, mask_BT, **options)`, so
`critic_free_advantages(name, ...)` can select one by name from `CRITIC_FREE_ESTIMATORS`.
Samples of the same prompt are consecutive rows: rows [g*G, (g+1)*G) form group g.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megarlhf.rl.kl import check_rows, check_same_shape, kl_shaped_rewards


def _check_unit_interval(**values: float) -> None:
    for name, value in values.items():
        if not 0.0 <= value <= 1.0:
            raise ValueError(f"{name} must be in [0, 1], got {value}")


@torch.no_grad()
def gae(
    rewards_BT: torch.Tensor,
    values_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation; returns (advantages_BT, returns_BT).

    Over each row's response tokens t (mask 1), from the last to the first:
        delta_t = r_t + gamma * V_{t+1} - V_t        (V after the last response token is 0)
        A_t     = delta_t + gamma * lam * A_{t+1}    (A after the last response token is 0)
        R_t     = A_t + V_t
    as in DeepSpeed-Chat's `get_advantages_and_returns`. Positions with mask 0 are skipped, not
    treated as time steps: for one contiguous run per row (prompt offset, right padding) this
    is exactly the formula above; a row with several runs (multi-turn, environment tokens
    masked out) is treated as one response with the gaps removed.
    """
    check_same_shape(rewards=rewards_BT, values=values_BT, mask=mask_BT)
    _check_unit_interval(gamma=gamma, lam=lam)
    mask = mask_BT.bool()
    advantages_BT = torch.zeros_like(rewards_BT)
    next_value_B = rewards_BT.new_zeros(rewards_BT.shape[0])
    next_adv_B = rewards_BT.new_zeros(rewards_BT.shape[0])
    for t in reversed(range(rewards_BT.shape[1])):
        here_B = mask[:, t]
        delta_B = rewards_BT[:, t] + gamma * next_value_B - values_BT[:, t]
        adv_B = delta_B + gamma * lam * next_adv_B
        # Masked positions carry the recursion's state through unchanged.
        next_adv_B = torch.where(here_B, adv_B, next_adv_B)
        next_value_B = torch.where(here_B, values_BT[:, t], next_value_B)
        advantages_BT[:, t] = torch.where(here_B, adv_B, 0.0)
    returns_BT = torch.where(mask, advantages_BT + values_BT, 0.0)
    return advantages_BT, returns_BT


@torch.no_grad()
def masked_whiten(
    x_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    shift_mean: bool = True,
    eps: float = 1e-8,
) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the masked elements of ALL ranks in `group`.

    mean and the UNBIASED variance (divided by n - 1, as TRL's and DeepSpeed-Chat's
    `masked_whiten`) are computed from the count, sum and sum of squares of the masked
    elements, all-reduced across `group` in float64 (one collective; float64 keeps the
    sum-of-squares form accurate). `group=None` means this process only, NOT the default
    group. With shift_mean=False the mean is added back (only the scale changes). Masked-out
    positions are 0 in the output. Needs n >= 2 masked elements in total, else ValueError.
    """
    check_same_shape(x=x_BT, mask=mask_BT)
    mask = mask_BT.bool()
    x = torch.where(mask, x_BT.double(), 0.0)
    stats = torch.stack([mask.sum().double(), x.sum(), x.square().sum()])
    if group is not None:
        dist.all_reduce(stats, group=group)
    n, total, total_sq = stats.tolist()
    if n < 2:
        raise ValueError(f"whitening needs at least 2 masked elements across the group, got "
                         f"{int(n)}")
    mean = total / n
    var = max(total_sq - n * mean * mean, 0.0) / (n - 1)
    whitened = (x - mean) * (var + eps) ** -0.5
    if not shift_mean:
        whitened = whitened + mean
    return torch.where(mask, whitened, 0.0).to(x_BT.dtype)


def _groups(score_B: torch.Tensor, mask_BT: torch.Tensor, group_size: int,
            min_size: int) -> torch.Tensor:
    """Scores as [B/G, G], after checking the layout."""
    check_rows(score_B, mask_BT)
    if group_size < min_size:
        raise ValueError(f"group_size must be >= {min_size} (samples per prompt), got "
                         f"{group_size}")
    if score_B.shape[0] % group_size:
        raise ValueError(f"batch of {score_B.shape[0]} sequences does not split into groups of "
                         f"{group_size} samples per prompt")
    return score_B.reshape(-1, group_size)


def _broadcast(adv_B: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
    return torch.where(mask_BT.bool(), adv_B.unsqueeze(-1), 0.0)


def _members(score_B: torch.Tensor, scored_B: torch.Tensor | None, group_size: int
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(scores [B/G, G] with 0 off the members, members [B/G, G] bool, members per group
    [B/G, 1]): a group's members are its scored samples (`scored_B`; None: all), and a group
    with fewer than two has none (no baseline to compare with: `trained_samples`)."""
    score_GG = score_B.reshape(-1, group_size)
    if scored_B is None:
        member_GG = torch.ones_like(score_GG, dtype=torch.bool)
    else:
        check_rows(scored_B, score_B[:, None])
        member_GG = scored_B.reshape(-1, group_size).bool()
        member_GG = member_GG & (member_GG.sum(dim=-1, keepdim=True) >= 2)
    count_G1 = member_GG.sum(dim=-1, keepdim=True)
    return torch.where(member_GG, score_GG, 0.0), member_GG, count_G1


def trained_samples(scored_B: torch.Tensor, group_size: int | None) -> torch.Tensor:
    """[B] bool: the samples a step trains on. A sample whose score failed is never one;
    with a group estimator (`group_size`), neither is any sample of a group left with fewer
    than two scored members."""
    if group_size is None:
        return scored_B.bool()
    scored_GG = scored_B.bool().reshape(-1, group_size)
    return (scored_GG & (scored_GG.sum(dim=-1, keepdim=True) >= 2)).reshape(-1)


@torch.no_grad()
def grpo_advantages(score_B: torch.Tensor, mask_BT: torch.Tensor, *, group_size: int,
                    scale_by_std: bool = True, eps: float = 1e-6,
                    scored_B: torch.Tensor | None = None) -> torch.Tensor:
    """GRPO (Shao et al. 2024), outcome supervision, broadcast over the response tokens.

        A_i = (r_i - mean_group(r)) / (std_group(r) + eps)      std unbiased (torch.std)
        A_i =  r_i - mean_group(r)           with scale_by_std=False (Dr. GRPO)

    group_size >= 2 (one sample per prompt has no group to compare with). With `scored_B`
    [B] bool the group statistics are over its scored members only; the others get 0
    (`_members`).
    """
    _groups(score_B, mask_BT, group_size, min_size=2)
    score_GG, member_GG, count_G1 = _members(score_B, scored_B, group_size)
    n_G1 = count_G1.clamp(min=1)
    adv_GG = score_GG - score_GG.sum(dim=-1, keepdim=True) / n_G1
    if scale_by_std:
        var_G1 = torch.where(member_GG, adv_GG, 0.0).square().sum(dim=-1, keepdim=True) / \
            (count_G1 - 1).clamp(min=1)
        adv_GG = adv_GG / (var_G1.sqrt() + eps)
    return _broadcast(torch.where(member_GG, adv_GG, 0.0).reshape(-1), mask_BT)


@torch.no_grad()
def rloo_advantages(score_B: torch.Tensor, mask_BT: torch.Tensor, *,
                    group_size: int, scored_B: torch.Tensor | None = None) -> torch.Tensor:
    """RLOO (Ahmadian et al. 2024): A_i = r_i - mean_{j != i} r_j over the prompt's group.

    = r_i - (sum_j r_j - r_i) / (G - 1), broadcast over the response tokens; G >= 2. With
    `scored_B`, j and G run over the group's scored members only (`_members`).
    """
    _groups(score_B, mask_BT, group_size, min_size=2)
    score_GG, member_GG, count_G1 = _members(score_B, scored_B, group_size)
    baseline_GG = (score_GG.sum(dim=-1, keepdim=True) - score_GG) / (count_G1 - 1).clamp(min=1)
    return _broadcast(torch.where(member_GG, score_GG - baseline_GG, 0.0).reshape(-1), mask_BT)


@torch.no_grad()
def reinforce_pp_advantages(
    score_B: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    logp_BT: torch.Tensor,
    ref_logp_BT: torch.Tensor,
    kl_coef: float,
    kl_kind: str = "k1",
    gamma: float = 1.0,
    clip_reward: float | None = None,
    kl_clamp: float | None = None,
    group: dist.ProcessGroup | None = None,
    eps: float = 1e-8,
) -> torch.Tensor:
    """REINFORCE++ (Hu 2025): KL-shaped token rewards -> returns-to-go -> global whitening.

        r_t = `kl_shaped_rewards(score, logp, ref_logp, mask, kl_coef, kl_kind, clip_reward,
                                 kl_clamp)`
        G_t = sum_{k >= t, response} gamma^(k - t) r_k
        A   = masked_whiten(G, mask, group)   (mean and variance over the whole DP batch)

    Pass the data-parallel group as `group`: whitening per rank would make the advantages
    depend on how the batch is split. Returns-to-go are `gae` with V = 0 and lam = 1.
    """
    rewards_BT = kl_shaped_rewards(score_B, logp_BT, ref_logp_BT, mask_BT, kl_coef=kl_coef,
                                   kind=kl_kind, clip_reward=clip_reward, kl_clamp=kl_clamp)
    returns_BT, _ = gae(rewards_BT, torch.zeros_like(rewards_BT), mask_BT, gamma=gamma, lam=1.0)
    return masked_whiten(returns_BT, mask_BT, group=group, eps=eps)


@torch.no_grad()
def reinforce_pp_baseline_advantages(score_B: torch.Tensor, mask_BT: torch.Tensor, *,
                                     group_size: int, scored_B: torch.Tensor | None = None,
                                     **options) -> torch.Tensor:
    """REINFORCE++-baseline: subtract the prompt group's mean score, then `reinforce_pp_advantages`.

        score_i <- score_i - mean_group(score)
    (OpenRLHF's "reinforce_baseline"; clip_reward, when given, clips this centred score.)
    `options` are those of `reinforce_pp_advantages`. group_size >= 2. With `scored_B`, the
    mean is over the group's scored members (`_members`); leave the others out of `mask_BT`
    (`trained_samples`), so the whitening does not count them.
    """
    _groups(score_B, mask_BT, group_size, min_size=2)
    score_GG, member_GG, count_G1 = _members(score_B, scored_B, group_size)
    centred_GG = score_GG - score_GG.sum(dim=-1, keepdim=True) / count_G1.clamp(min=1)
    centred_B = torch.where(member_GG, centred_GG, 0.0).reshape(-1)
    return reinforce_pp_advantages(centred_B, mask_BT, **options)


@torch.no_grad()
def distillation_advantages(teacher_logp_BT: torch.Tensor, logp_BT: torch.Tensor,
                            mask_BT: torch.Tensor, *, coef: float,
                            clip: float | None = None) -> torch.Tensor:
    """On-policy distillation's per-token term: each sampled token moves toward the teacher
    by the reverse KL's single-sample estimate at that token,

        d_t = coef * (log pi_teacher(y_t) - log pi_student(y_t)),   clamped to [-clip, clip]

    `logp_BT` is the student's old logprob of the token (the one the importance ratio divides
    by), so a teacher equal to the student gives exactly 0. Per token, undiscounted: the
    on-policy distillation recipe's, not a return. 0 off the mask.
    """
    check_same_shape(teacher_logp_BT=teacher_logp_BT, logp_BT=logp_BT, mask_BT=mask_BT)
    term_BT = coef * (teacher_logp_BT - logp_BT)
    if clip is not None:
        term_BT = term_BT.clamp(-clip, clip)
    return torch.where(mask_BT.bool(), term_BT, 0.0)


CRITIC_FREE_ESTIMATORS = {
    "grpo": grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce++": reinforce_pp_advantages,
    "reinforce++_baseline": reinforce_pp_baseline_advantages,
}


GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce++_baseline")
"""The estimators whose baseline is the prompt's group (they take group_size and scored_B)."""


def critic_free_advantages(name: str, score_B: torch.Tensor, mask_BT: torch.Tensor,
                           **options) -> torch.Tensor:
    """advantages_BT from the estimator called `name` (see `CRITIC_FREE_ESTIMATORS`)."""
    if name not in CRITIC_FREE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; choose one of "
                         f"{sorted(CRITIC_FREE_ESTIMATORS)}")
    return CRITIC_FREE_ESTIMATORS[name](score_B, mask_BT, **options)
