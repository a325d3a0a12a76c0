"""The logprob-gap guard for every weight sync of an async run.

With asynchronous rollouts (rollout_mode one_step_off or fully_async) a step trains on
samples of older weights, so their gap to the actor holds the updates too and the guard cannot
judge them (it runs at lag 0 only: the first step and the first after a resume). A sync that breaks later would go unseen. So after each
sync, while the engine and the actor hold the same weights (the next update comes later), a
few of the step's prompts are sampled once each with the fresh weights and the engine's
logprobs are held to the actor's under the same limits. The seconds it costs are reported
as `time/gap_probe`. (A resumed async run's first sync, the checkpoint's weights, is probed
after its first step, like every later one; the sync's projection read-back checks it at
once.)
"""

from __future__ import annotations

from megarlhf.ppo.config import PPOConfig
from megarlhf.ppo.inputs import RunInputs
from megarlhf.ppo.placement import Placement
from megarlhf.ppo.rollouts import sampling
from megarlhf.rollout.experience import rollout_batch
from megarlhf.rollout.gap import check_gap, logprob_gap

PROMPTS = 2
"""Prompts a probe samples (once each): a broken sync moves nearly every token, so a few
dozen tokens show it; more would only lengthen the step."""
_SEED = 2**44
"""Offsets the probe's sampling seed from the training rounds' (multiples of
rollouts._ROUND_SEED, 2**32) and episodes' turns (envs.episodes.TURN_SEED, 2**40)."""


def probe(config: PPOConfig, data: RunInputs, workers: Placement, prompts: list, step: int
          ) -> tuple[dict[str, float], str | None]:
    """(metrics, warning or None); raises LogprobGapError when the policy is 'stop'.
    `prompts`: the step's, samples_per_prompt in a row each."""
    ids = [list(p.ids) for p in prompts[::config.samples_per_prompt][:PROMPTS]]
    params = sampling(config, data, n=1, temperature=config.temperature,
                      seed=config.seed * 1_000_003 + step + _SEED)
    sampled = rollout_batch(ids, workers.rollout(ids, params))
    routing = sampled.routing if config.routing_replay else None
    trainer = workers.experience(sampled.sequences, frozenset({"actor"}), routing)
    limits = config.gap_limits
    gap = logprob_gap(sampled.engine_logp, trainer["logp"], sampled.sequences.response_mask,
                      limits.max)
    warning = check_gap(gap, limits, policy=config.logprob_gap_policy, step=step, probe=True)
    return gap.to_dict("rollout/probe_"), warning
