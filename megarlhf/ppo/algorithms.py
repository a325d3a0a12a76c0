"""What each `algorithm=` means: an advantage estimator and the default of every loss, KL and
sampling option, as the algorithm's paper and verl define it. A run config's option fields
default to None, "the algorithm's value"; a value given there wins (`algorithm=dapo
clip_eps_high=0.3` is DAPO with a wider upper clip). `resolve` gives the options a run uses;
docs/guides/algorithms.md's table lists them, and `megarlhf ppo --dry-run` prints them.
"""

from __future__ import annotations

import dataclasses



@dataclasses.dataclass(frozen=True)
class AlgorithmOptions:
    estimator: str
    """Advantage estimator: 'gae' (with the critic), one of CRITIC_FREE_ESTIMATORS, or 'opd'
    (none: the advantages are the distillation term alone)."""
    clip_eps: float
    clip_eps_high: float
    ratio_level: str
    policy_loss: str
    aggregation: str
    advantage_std_norm: bool
    """Group estimator (grpo) only: divide by the group's reward std."""
    whiten_advantages: bool
    kl_coef: float
    kl_in: str
    """'reward' (a per-token penalty in the reward) or 'loss' (a term of the actor's loss)."""
    kl_estimator: str
    dynamic_sampling: bool
    overlong_buffer: int
    """Tokens before max_new_tokens where the overlong penalty starts (0: off)."""
    distill_coef: float
    """Weight of the per-token distillation term added to the advantages (0: off)."""

    @property
    def critic(self) -> bool:
        return self.estimator == "gae"


_PPO = dict(estimator="gae", clip_eps=0.2, clip_eps_high=None, ratio_level="token",
            policy_loss="clip", aggregation="token_mean", advantage_std_norm=False,
            whiten_advantages=True, kl_coef=0.05, kl_in="reward", kl_estimator="k1",
            dynamic_sampling=False, overlong_buffer=0, distill_coef=0.0)
# The group methods: verl's GRPO (a k3 KL loss of 0.001 against the reference, no in-reward
# KL, group advantages not whitened again over the batch) and what each 2025 variant changes.
_GRPO = {**_PPO, "estimator": "grpo", "advantage_std_norm": True, "whiten_advantages": False,
         "kl_coef": 0.001, "kl_in": "loss", "kl_estimator": "k3"}
_NO_KL = {"kl_coef": 0.0}
PRESETS: dict[str, dict] = {
    "ppo": _PPO,
    "grpo": _GRPO,
    # RLOO and REINFORCE++ put the KL in the reward, as their papers and OpenRLHF do.
    "rloo": {**_GRPO, "estimator": "rloo", "advantage_std_norm": False, "kl_coef": 0.05,
             "kl_in": "reward", "kl_estimator": "k1"},
    # REINFORCE++ whitens its returns over the batch as part of the estimator, once.
    "reinforce++": {**_PPO, "estimator": "reinforce++", "whiten_advantages": False},
    "reinforce++_baseline": {**_PPO, "estimator": "reinforce++_baseline",
                             "whiten_advantages": False},
    # DAPO (Yu et al. 2025): clip-higher, token-level loss, dynamic sampling, soft overlong
    # penalty over the last fifth of the budget (the paper's 4096 of 20480 tokens), no KL.
    "dapo": {**_GRPO, **_NO_KL, "clip_eps_high": 0.28, "dynamic_sampling": True,
             "overlong_buffer": "fifth"},
    # Dr. GRPO (Liu et al. 2025): no std normalisation, a constant loss normaliser, no KL.
    "dr_grpo": {**_GRPO, **_NO_KL, "advantage_std_norm": False,
                "aggregation": "seq_mean_token_sum_norm"},
    # GSPO (Zheng et al. 2025): sequence-level ratios, clipped at 3e-4 / 4e-4, no KL.
    "gspo": {**_GRPO, **_NO_KL, "ratio_level": "sequence", "clip_eps": 3e-4,
             "clip_eps_high": 4e-4, "aggregation": "seq_mean_token_mean"},
    # CISPO (MiniMax-M1, 2025): clipped stop-gradient weights on the REINFORCE term with no
    # lower bound on the weight; the upper bound and GRPO's KL loss as verl's CISPO example.
    "cispo": {**_GRPO, "policy_loss": "cispo", "clip_eps": 1.0, "clip_eps_high": 0.2},
    # On-policy distillation (Agarwal et al. 2024, Thinking Machines 2025): no reward and no
    # critic; each sampled token's advantage is the teacher's logprob minus the student's
    # (the reverse KL's per-token estimate), undiscounted, not normalised, no KL to the
    # reference (the teacher is the anchor).
    "opd": {**_PPO, **_NO_KL, "estimator": "opd", "whiten_advantages": False,
            "distill_coef": 1.0},
}
ALGORITHMS = tuple(PRESETS)
OPTION_FIELDS = tuple(f.name for f in dataclasses.fields(AlgorithmOptions)
                      if f.name != "estimator")
"""The PPOConfig fields that default to the algorithm's value."""


def resolve(config) -> AlgorithmOptions:
    """The options a run with `config` (a PPOConfig) uses: its algorithm's preset, overridden
    by every option field the config sets."""
    preset = PRESETS[config.algorithm]
    values = {name: preset[name] if getattr(config, name) is None else getattr(config, name)
              for name in OPTION_FIELDS}
    if values["clip_eps_high"] is None:
        values["clip_eps_high"] = values["clip_eps"]
    if values["overlong_buffer"] == "fifth":
        values["overlong_buffer"] = max(1, config.max_new_tokens // 5)
    return AlgorithmOptions(estimator=preset["estimator"], **values)


def describe(config) -> str:
    """The options `config` runs with, in one line (the dry run prints it)."""
    o = resolve(config)
    kl = (f"KL {o.kl_estimator} x {o.kl_coef} in the {o.kl_in}" if o.kl_coef else "no KL")
    estimator = "no reward advantages" if o.estimator == "opd" else f"{o.estimator} advantages"
    parts = [estimator + (" / group std" if o.advantage_std_norm else "")
             + (", whitened" if o.whiten_advantages else ""),
             f"{o.policy_loss} loss on {o.ratio_level} ratios in "
             f"[1 - {o.clip_eps:g}, 1 + {o.clip_eps_high:g}]", o.aggregation, kl]
    if o.dynamic_sampling:
        parts.append(f"dynamic sampling (up to {config.dynamic_sampling_rounds} extra rounds)")
    if o.distill_coef:
        parts.append(f"distillation term {o.distill_coef:g} x (teacher - student logprob)"
                     + (f" clipped at {config.distill_clip:g}" if config.distill_clip else ""))
    if o.overlong_buffer:
        parts.append(f"overlong penalty over the last {o.overlong_buffer} tokens")
    if config.rollout_correction != "none":
        parts.append(f"rollout correction {config.rollout_correction} per "
                     f"{config.rollout_correction_level} at {config.rollout_correction_threshold}")
    return "; ".join(parts)
