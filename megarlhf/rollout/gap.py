"""The train/rollout logprob gap: how far the rollout engine's logprobs of the sampled tokens
are from the trainer's logprobs of the same sequences, over response tokens.

A gap well above numerical noise means the two do not run the same model (a stale or mis-synced
weight, a different RoPE or vocabulary), or the engine reports processed logprobs (after
temperature or penalties); both bias importance ratios in PPO. Log it after every sync.

Legend: B rows, T columns, aligned as in data/sequences.py (column t: log p(token_t | <t)).
"""

from __future__ import annotations

import dataclasses
import math

import torch


@dataclasses.dataclass(frozen=True)
class LogprobGap:
    mean_abs: float
    """Mean |engine - trainer| over response tokens."""
    max_abs: float
    """Largest |engine - trainer| over response tokens."""
    num_tokens: int
    over: int = 0
    """Tokens whose |engine - trainer| is above the `max_limit` logprob_gap was given."""

    def to_dict(self, prefix: str = "rollout/") -> dict[str, float]:
        return {f"{prefix}logprob_gap_mean": self.mean_abs,
                f"{prefix}logprob_gap_max": self.max_abs,
                f"{prefix}logprob_gap_over_max_limit": self.over / self.num_tokens}


def logprob_gap(engine_logp_BT: torch.Tensor, trainer_logp_BT: torch.Tensor,
                response_mask_BT: torch.Tensor, max_limit: float = math.inf) -> LogprobGap:
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
                      num_tokens=int(mask.sum()), over=int((diff > max_limit).sum()))


GAP_POLICIES = ("stop", "warn")
DEFAULT_GAP_LIMITS = {"fp32": 1e-3, "bf16": 5e-2, "fp16": 5e-2}
"""Mean |gap| per token above which rollouts are not from the trained policy. fp32: kernels
differ by ~1e-6 (measured max 3e-6 on toy models, 2e-5 over 30 layers); a mis-synced tied
embedding measured a mean of 0.56. 16-bit: rounding of logits moves single tokens by up to a
few hundredths, the mean stays well below these limits."""

DEFAULT_GAP_MAX_LIMITS = {"fp32": 5e-2, "bf16": 2.0, "fp16": 2.0}
"""|gap| a single response token should stay under. A few corrupted tokens (one mangled row
of the output projection, sampled now and then) leave the mean near noise but stand out here.
fp32: measured maxima 9.5e-7 (toy, H200) to 4.9e-5 (SmolLM2, 30 layers, CPU), so 1000x room.
16-bit: single tokens reach 0.48 on SmolLM2 in bf16 (rare low-probability tokens whose logits
round apart), so 4x room; a mis-synced row moves its tokens by whole nats."""
GAP_TAIL_SHARES = {"fp32": 0.0, "bf16": 1e-3, "fp16": 1e-3}
"""Share of a step's response tokens that may be over the max limit. fp32: none. 16-bit:
one in a thousand, because one measurement of the bf16 tail (a small model) cannot promise
that no legitimate token of a large vocabulary, a long answer or an unreplayed MoE routing
ever passes 2 nats, and a stopped 70B run costs more than a missed outlier; a corrupted row
drawn that often, or any sync fault, still shows (and the sync's projection read-back,
rollout/projection.py, checks every row whether drawn or not)."""


@dataclasses.dataclass(frozen=True)
class GapLimits:
    """What a step's gap is held to: `mean` per token, and at most `tail_share` of the tokens
    over `max`."""

    mean: float
    max: float
    tail_share: float

    @classmethod
    def of(cls, dtype: str, mean: float | None = None, max_: float | None = None) -> "GapLimits":
        """The dtype's defaults where a limit is not given."""
        return cls(mean=mean or DEFAULT_GAP_LIMITS[dtype],
                   max=max_ or DEFAULT_GAP_MAX_LIMITS[dtype], tail_share=GAP_TAIL_SHARES[dtype])


def within(gap: LogprobGap, limits: GapLimits) -> bool:
    """Whether `gap` (computed with max_limit=limits.max) is within `limits`."""
    return gap.mean_abs <= limits.mean and gap.over <= limits.tail_share * gap.num_tokens


@dataclasses.dataclass(frozen=True)
class GapGuard:
    """The gap guard of an update pass that computes the old logprobs itself (one update per
    batch): the pass holds its logprobs to the engine's before its optimizer step, and the
    actor does not step when the guard would stop the run (the controller then raises with
    check_gap's message, before any checkpoint; a critic in the same group has stepped in
    memory by then, and is dropped with the run)."""

    engine_logp: torch.Tensor
    """[B, T]: the rollout engine's logprobs of the batch's sampled tokens."""
    limits: GapLimits
    policy: str

    def allows_step(self, trainer_logp_BT: torch.Tensor, response_mask_BT: torch.Tensor) -> bool:
        if self.policy != "stop":
            return True
        device = self.engine_logp.device
        return within(logprob_gap(self.engine_logp, trainer_logp_BT.to(device),
                                  response_mask_BT.to(device), self.limits.max), self.limits)


class LogprobGapError(RuntimeError):
    """The engine's logprobs are too far from the trainer's and the policy is 'stop'."""


def check_gap(gap: LogprobGap, limits: GapLimits, *, policy: str, step: int,
              probe: bool = False) -> str | None:
    """None when `gap` (computed with max_limit=limits.max) is within `limits`; else raise
    LogprobGapError ('stop') or return the warning ('warn'). The message says what the gap
    means and where to look; `probe`: the samples were a probe's after the step's sync."""
    if within(gap, limits):
        return None
    over = (f"{gap.mean_abs:.3g} nats per token on average (max {gap.max_abs:.3g}; "
            f"logprob_gap_limit={limits.mean:g})" if gap.mean_abs > limits.mean else
            f"more than {limits.max:g} nats on {gap.over} of {gap.num_tokens} tokens (max "
            f"{gap.max_abs:.3g}, mean {gap.mean_abs:.3g}; "
            f"logprob_gap_max_limit={limits.max:g})")
    when = f"step {step}'s weight-sync probe" if probe else f"step {step}"
    message = (f"{when}: the rollout engine's logprobs of its own samples differ from the "
               f"trainer's by {over}: the engine is not sampling "
               f"from the policy being trained. Likely causes: a weight sync that missed or "
               f"mangled tensors (tied embeddings, a new architecture's names), a tokenizer or "
               f"chat template that differs between engine and trainer, or the rollout dtype. "
               f"logprob_gap_policy=warn continues anyway.")
    if policy == "stop":
        raise LogprobGapError(message)
    return message
