"""What is done to rewards and groups before advantages: DAPO's (Yu et al. 2025) soft penalty
for responses that run into the generation budget, and its test that a prompt's group of
samples can teach anything (GRPO-style advantages of a group with equal rewards are all 0);
and the reward clip (clip_reward) of turn rewards and totals.

Legend: B batch (sequences), G group size (samples per prompt); samples of the same prompt
are consecutive rows.
"""

from __future__ import annotations

import torch


@torch.no_grad()
def overlong_penalty(lengths_B: torch.Tensor, *, max_len: int, buffer: int,
                     factor: float = 1.0) -> torch.Tensor:
    """[B] penalties (<= 0) added to the reward of responses near the length budget:

        0                                      length <= max_len - buffer
        factor * (max_len - buffer - length) / buffer     above, down to -factor at max_len
    (DAPO's soft overlong punishment, L_max = max_len, L_cache = buffer)."""
    if not 0 < buffer <= max_len:
        raise ValueError(f"need 0 < buffer <= max_len, got buffer={buffer}, max_len={max_len}")
    over_B = lengths_B.double() - (max_len - buffer)
    return (-factor * over_B.clamp(min=0) / buffer).float()


@torch.no_grad()
def varied_groups(score_B: torch.Tensor, group_size: int,
                  scored_B: torch.Tensor | None = None) -> torch.Tensor:
    """[B/G] bool: the groups whose scores are not all equal (DAPO's dynamic sampling keeps
    only these); with `scored_B` [B] bool, over their scored samples only (a group with fewer
    than two has nothing to compare)."""
    if score_B.dim() != 1 or score_B.shape[0] % group_size:
        raise ValueError(f"scores {tuple(score_B.shape)} do not split into groups of "
                         f"{group_size}")
    score_GG = score_B.reshape(-1, group_size)
    if scored_B is None:
        return score_GG.amax(dim=-1) > score_GG.amin(dim=-1)
    scored_GG = scored_B.bool().reshape(-1, group_size)
    high = torch.where(scored_GG, score_GG, -torch.inf).amax(dim=-1)
    low = torch.where(scored_GG, score_GG, torch.inf).amin(dim=-1)
    return (scored_GG.sum(dim=-1) >= 2) & (high > low)


@torch.no_grad()
def clip_rewards(score_B: torch.Tensor, placed_BT: torch.Tensor, clip: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(score_B, placed_BT) clipped as they are trained: each reward given at a token (a
    multi-turn episode's turn rewards, `placed_BT`) to [-clip, clip], then each sample's
    total, its clipped turn rewards plus the rest of its score (score_B - placed.sum(1), the
    reward function's, the reward model's...), to [-clip, clip] too.

        placed' = clip(placed)         score' = clip(sum(placed') + score - sum(placed))
    """
    if clip <= 0:
        raise ValueError(f"clip_reward must be > 0, got {clip}")
    rest_B = score_B - placed_BT.sum(dim=1)
    placed_BT = placed_BT.clamp(-clip, clip)
    return (placed_BT.sum(dim=1) + rest_B).clamp(-clip, clip), placed_BT
