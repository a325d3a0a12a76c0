"""The train/rollout logprob gap: how far the rollout engine's logprobs of the sampled tokens
are from the trainer's logprobs of the same sequences, over response tokens.

A gap well above numerical noise means the two do not run the same model (a stale or mis-synced
weight, a different RoPE or vocabulary), or the engine reports processed logprobs (after
temperature or penalties); both bias importance ratios in PPO. Log it after every sync.

Legend: B rows, T columns, aligned as in roles/sequences.py (column t: log p(token_t | <t)).
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class LogprobGap:
    mean_abs: float
    """Mean |engine - trainer| over response tokens."""
    max_abs: float
    """Largest |engine - trainer| over response tokens."""
    num_tokens: int

    def to_dict(self, prefix: str = "rollout/") -> dict[str, float]:
        return {f"{prefix}logprob_gap_mean": self.mean_abs,
                f"{prefix}logprob_gap_max": self.max_abs}


def logprob_gap(engine_logp_BT: torch.Tensor, trainer_logp_BT: torch.Tensor,
                response_mask_BT: torch.Tensor) -> LogprobGap:
    if not engine_logp_BT.shape == trainer_logp_BT.shape == response_mask_BT.shape:
        raise ValueError(f"shapes differ: engine logprobs {tuple(engine_logp_BT.shape)}, "
                         f"trainer logprobs {tuple(trainer_logp_BT.shape)}, response mask "
                         f"{tuple(response_mask_BT.shape)}")
    mask = response_mask_BT.bool()
    if not bool(mask.any()):
        raise ValueError("the response mask is empty: no tokens to compare")
    # float64: the gap is often ~1e-7, below what a float32 mean of many tokens resolves.
    diff = (engine_logp_BT.double() - trainer_logp_BT.double()).abs()[mask]
    return LogprobGap(mean_abs=float(diff.mean()), max_abs=float(diff.max()),
                      num_tokens=int(mask.sum()))
