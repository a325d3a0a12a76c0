"""What DAPO (Yu et al. 2025) does to rewards and groups before advantages: a soft penalty for
responses that run into the generation budget, and the test that a prompt's group of samples
can teach anything (GRPO-style advantages of a group with equal rewards are all 0).

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
def varied_groups(score_B: torch.Tensor, group_size: int) -> torch.Tensor:
    """[B/G] bool: the groups whose scores are not all equal (DAPO's dynamic sampling keeps
    only these)."""
    if score_B.dim() != 1 or score_B.shape[0] % group_size:
        raise ValueError(f"scores {tuple(score_B.shape)} do not split into groups of "
                         f"{group_size}")
    score_GG = score_B.reshape(-1, group_size)
    return score_GG.amax(dim=-1) > score_GG.amin(dim=-1)
