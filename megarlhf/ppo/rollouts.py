"""A step's rollout: prompts drawn, answered by the rollout engines (samples_per_prompt each)
and scored. With dynamic sampling (DAPO), a prompt whose samples all got the same reward
teaches nothing (its group advantages are 0): such groups are dropped and further rounds of
prompts generated, up to dynamic_sampling_rounds, until the step has prompts_per_step groups.
The batch keeps its shape, so it still splits into mini-batches x DP x micro-batches: when
the rounds run out, dropped groups complete it (counted in rollout/dynamic_sampling_short).

With an environment each sample is a multi-turn episode (megarlhf/envs/episodes.py), scored
with the sum of its turns' rewards (plus the reward function and reward model, when set).

A sample whose score could not be computed (by any source) is failed, never a number: its
score is NaN and its reason is kept (`failed`), and the controller masks it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from megarlhf.data.prompts import Prompt
from megarlhf.envs.episodes import Episode
from megarlhf.ppo.config import PPOConfig
from megarlhf.ppo.inputs import RunInputs
from megarlhf.ppo.placement import Placement
from megarlhf.ppo.rewards import RewardFnError
from megarlhf.rewards.calls import Sample
from megarlhf.rl.shaping import overlong_penalty, varied_groups
from megarlhf.rollout.engine import Completion, SamplingParams
from megarlhf.rollout.experience import rollout_batch

_log = logging.getLogger(__name__)

_ROUND_SEED = 2**32
"""Seed offset between a step's generation rounds (steps differ by 1, so rounds never reuse a
step's seed)."""


@dataclasses.dataclass
class Answers:
    """samples_per_prompt answers to each of some prompts, a prompt's consecutive."""

    prompts: list[Prompt]
    """One per answer: the prompt it answers (an episode's, with what its environment's reset
    added)."""
    completions: list[Completion]
    """prompt_index: the answer's own row."""
    episodes: list[Episode] | None
    """With an environment: the episodes the completions are."""
    metrics: dict[str, float]
    """The environment's (env/...)."""

    def rows(self, rows: slice) -> "Answers":
        return Answers(self.prompts[rows], self.completions[rows],
                       self.episodes[rows] if self.episodes is not None else None, {})


def answer(data: RunInputs, workers: Placement, prompts: list[Prompt],
           params: SamplingParams) -> Answers:
    """params.n answers per prompt from the rollout engines: one completion each, or with an
    environment an episode each."""
    if data.episodes is None:
        completions = workers.rollout([list(p.ids) for p in prompts], params)
        return Answers([prompts[c.prompt_index] for c in completions],
                       [dataclasses.replace(c, prompt_index=row)
                        for row, c in enumerate(completions)], None, {})
    episodes, metrics = data.episodes.run(prompts, params, workers.rollout)
    return Answers([e.prompt for e in episodes], [e.completion for e in episodes], episodes,
                   metrics)


@dataclasses.dataclass
class Group:
    """One prompt's samples: its answers, the reward function's view of them, and their
    scores."""

    answers: Answers
    samples: list[Sample]
    score: torch.Tensor
    judged: list[dict] | None
    failed: list[str | None] | None = None
    """Per sample: why it has no score, or None (None: all scored, as in groups a
    fully_async checkpoint kept from before the field)."""


@dataclasses.dataclass
class StepRollout:
    prompts: list[Prompt]
    completions: list[Completion]
    """samples_per_prompt per prompt, in prompt order; prompt_index points into prompts."""
    samples: list[Sample]
    score: torch.Tensor
    """[B] reward-model score + reward function + overlong penalty."""
    metrics: dict[str, float]
    seconds: dict[str, float]
    """Time spent generating ('rollout') and scoring ('reward'), over all rounds."""
    weight_version: int
    """The actor updates the engine's weights held when it sampled (the step of its last
    weight sync)."""
    busy: dict[str, float] = dataclasses.field(default_factory=dict)
    """Drawn ahead (one_step_off): the workers' seconds of each phase it called."""
    episodes: list[Episode] | None = None
    """With an environment: the episodes the completions are (their transcripts, and the
    turns' rewards at their tokens)."""
    judged: list[dict] | None = None
    """With reward_judge: per sample, what the judge wrote and its score (samples.jsonl's
    judge and judge_score)."""
    versions: list[list[int]] | None = None
    """rollout_mode=fully_async: per sample, the weight version each token was sampled under
    (weight_version is the oldest of them)."""
    failed: list[str | None] | None = None
    """Per sample: why it has no score (its score is NaN), or None (None: all scored, as in
    rollouts a checkpoint kept from before the field)."""

    def scored(self) -> torch.Tensor:
        """[B] bool: the samples with a score."""
        return scored_mask(self.failed or [None] * len(self.samples))


def draw(config: PPOConfig, data: RunInputs, workers: Placement, sampler, step: int,
         weight_version: int) -> StepRollout:
    """The step's groups (see the module doc), sampled by an engine holding the weights after
    `weight_version` updates."""
    o, n = config.options, config.samples_per_prompt
    kept, dropped, scored, seconds = [], [], [], {"rollout": 0.0, "reward": 0.0}
    failed = []  # every round's, the groups dynamic sampling dropped too
    for round_ in range(1 + (config.dynamic_sampling_rounds if o.dynamic_sampling else 0)):
        prompts = sampler.next(config.prompts_per_step)
        # resume-stable: the same step and round draw the same samples
        params = sampling(config, data, n=n, temperature=config.temperature,
                          seed=config.seed * 1_000_003 + step + round_ * _ROUND_SEED)
        t = time.perf_counter()
        answers = answer(data, workers, prompts, params)
        seconds["rollout"] += time.perf_counter() - t
        t = time.perf_counter()
        samples = data.samples(answers.prompts, answers.completions, answers.episodes)
        scored_round = score_answers(config, data, workers, answers, samples, step)
        score, judged = scored_round.score, scored_round.judged
        failed += scored_round.failed
        seconds["reward"] += time.perf_counter() - t
        scored.append((len(samples), scored_round.metrics))
        varied = varied_groups(score, n, scored_round.scored()) if o.dynamic_sampling \
            else [True] * len(prompts)
        for g in range(len(prompts)):
            rows = slice(g * n, (g + 1) * n)
            group = Group(answers.rows(rows), samples[rows], score[rows],
                          judged[rows] if judged is not None else None,
                          scored_round.failed[rows])
            (kept if varied[g] else dropped).append(group)
        if len(kept) >= config.prompts_per_step:
            break
    short = config.prompts_per_step - min(len(kept), config.prompts_per_step)
    # Dynamic sampling drops a group with fewer than two scores as one without variance: the
    # bound counts what every round scored, so dropping cannot hide a failing scorer.
    check_failures(config, failed, f"step {step}")
    metrics = merge_metrics(scored)
    if o.dynamic_sampling:
        metrics.update({"rollout/dynamic_sampling_rounds": float(round_),
                        "rollout/dynamic_sampling_dropped": float(len(dropped)),
                        "rollout/dynamic_sampling_short": float(short)})
    return assemble(data, kept[:config.prompts_per_step] + dropped[:short], metrics, seconds,
                    weight_version)


def assemble(data: RunInputs, groups: list[Group], metrics: dict[str, float],
             seconds: dict[str, float], weight_version: int,
             versions: list[list[int]] | None = None) -> StepRollout:
    """A step's rollout of the `groups` chosen for it, in their order."""
    chosen = [g.answers for g in groups]
    return StepRollout(
        prompts=[p for a in chosen for p in a.prompts],
        completions=[dataclasses.replace(c, prompt_index=row) for row, c in
                     enumerate(c for a in chosen for c in a.completions)],
        samples=[s for g in groups for s in g.samples],
        score=torch.cat([g.score for g in groups]), metrics=metrics, seconds=seconds,
        weight_version=weight_version,
        episodes=[e for a in chosen for e in a.episodes] if data.episodes else None,
        judged=[t for g in groups for t in g.judged] if data.judge else None,
        versions=versions,
        failed=[f for g in groups for f in (g.failed or [None] * len(g.samples))])


class Rollouts:
    """Each step's rollout, drawn when the step starts, or (one_step_off) during the step
    before: the next step's rollout then runs in a thread beside this step's experience and
    training (the placement keeps the groups' calls apart) and is waited for before the
    weight sync, so the engine samples with weights one update behind the actor's. A
    checkpoint keeps the rollout drawn ahead (`pending`): a resumed run trains on the same
    samples as a straight one."""

    def __init__(self, config: PPOConfig, data: RunInputs, workers: Placement, sampler, *,
                 weight_version: int, pending: StepRollout | None = None):
        self.config, self.data, self.workers, self.sampler = config, data, workers, sampler
        self.weight_version = weight_version
        """The updates the engine's weights hold now."""
        self.pending = pending
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="rollout-ahead") \
            if config.resolved_rollout_mode == "one_step_off" else None
        self._ahead = None
        self.ahead_span: tuple[float, float] | None = None
        """Wall-clock (start, end) of the latest rollout drawn ahead."""

    def take(self, step: int) -> StepRollout:
        """Step `step`'s rollout (drawn ahead, or now); with one_step_off, start drawing the
        next step's."""
        drawn, self.pending = self.pending, None
        if drawn is None:
            drawn = draw(self.config, self.data, self.workers, self.sampler, step,
                         self.weight_version)
        if self._pool is not None and step < self.config.steps:
            self._ahead = self._pool.submit(self._draw_ahead, step + 1, self.weight_version)
        return drawn

    def _draw_ahead(self, step: int, weight_version: int) -> StepRollout:
        start = time.time()
        drawn = draw(self.config, self.data, self.workers, self.sampler, step, weight_version)
        self.ahead_span = (start, time.time())
        return dataclasses.replace(drawn, busy=self.workers.take_busy())  # this thread's

    def finish(self) -> None:
        """Wait for the rollout drawn ahead (the engine must be idle for the weight sync)."""
        if self._ahead is not None:
            ahead, self._ahead = self._ahead, None
            self.pending = ahead.result()

    def paused(self):
        """The engines idle for a weight sync (a rollout drawn ahead was finished by then)."""
        return contextlib.nullcontext()

    def idle(self):
        """Nothing runs between steps (a rollout drawn ahead is finished before the sync)."""
        return contextlib.nullcontext()

    def synced(self, step: int) -> None:
        self.weight_version = step

    def snapshot(self) -> tuple[dict, StepRollout | None]:
        """What a checkpoint keeps: the sampler's state and the rollout drawn ahead."""
        return self.sampler.state_dict(), self.pending

    def overlap(self) -> tuple[float, float] | None:
        """Wall-clock (start, end) of the rollout drawn beside this step, if one was."""
        return self.ahead_span if self.pending is not None else None

    def stop(self) -> None:
        """Nothing runs between steps (a rollout drawn ahead is finished before the sync)."""

    def drawing(self) -> bool:
        """A rollout is being drawn ahead (after a failed step)."""
        return self._ahead is not None and not self._ahead.done()

    def close(self) -> None:
        """Join the thread (after the workers' shutdown, which ends a call it waits on); a
        failure of a rollout no step waited for is logged, not lost."""
        if self._pool is None:
            return
        self._pool.shutdown(wait=True, cancel_futures=True)
        if self._ahead is not None and not self._ahead.cancelled() and \
                self._ahead.exception() is not None:
            _log.error("the rollout drawn ahead failed too: %r", self._ahead.exception())


def settings(config: PPOConfig) -> dict:
    """What a rollout drawn ahead was sampled and scored with: a resumed run with other
    values draws its first rollout again."""
    drawn = {name: getattr(config, name) for name in (
        "prompts_per_step", "samples_per_prompt", "max_new_tokens", "temperature", "top_p",
        "top_k", "stop_token_ids", "reward_fn", "reward_model")}
    mode = config.resolved_rollout_mode
    # The key checkpoints held before rollout_mode (named after the retired field), kept so
    # that theirs still compare equal for the same mode.
    drawn["async_rollout"] = mode == "one_step_off"
    if mode == "fully_async":  # named only when set, as below
        drawn.update(rollout_mode=mode, max_staleness=config.max_staleness,
                     partial_rollout_tokens=config.partial_rollout_tokens)
    if config.reward_url is not None:  # named only when set, as routing_replay below
        drawn["reward_url"] = config.reward_url
    if config.reward_judge is not None:
        drawn["reward_judge"] = dataclasses.asdict(config.reward_judge)
    if config.rewards:
        drawn["rewards"] = [dataclasses.asdict(t) for t in config.rewards]
    if config.routing_replay:  # the rollout must carry its routing; named only when on, so
        drawn["routing_replay"] = True  # checkpoints from before the field still match
    if config.environment is not None:  # likewise
        drawn.update({name: getattr(config, name) for name in (
            "environment", "env_args", "max_turns", "max_turn_tokens", "max_observation_tokens",
            "on_env_error", "tools", "tool_parser", "chat_template")})
    if config.agent is not None:
        drawn.update({name: getattr(config, name) for name in (
            "agent", "max_turns", "tool_parser", "chat_template")})
    return json.loads(json.dumps(drawn))


def sampling(config: PPOConfig, data: RunInputs, *, n: int, temperature: float, seed: int
             ) -> SamplingParams:
    """The run's sampling settings for `n` samples per prompt (training and validation)."""
    return SamplingParams(max_new_tokens=config.max_new_tokens, n=n, temperature=temperature,
                          top_p=config.top_p, top_k=config.top_k,
                          stop_token_ids=data.checked.stop_token_ids, seed=seed)


@dataclasses.dataclass
class Scored:
    score: torch.Tensor
    """[B]; NaN where `failed` names a reason."""
    metrics: dict[str, float]
    judged: list[dict] | None
    """With reward_judge (training rounds): per sample, the judge's text and score."""
    failed: list[str | None]
    """Per sample: why it has no score (the first source that failed it), or None."""

    def scored(self) -> torch.Tensor:
        return scored_mask(self.failed)


def score_answers(config: PPOConfig, data: RunInputs, workers: Placement, answers: Answers,
                  samples: list[Sample], step: int, *, validation: bool = False) -> Scored:
    """The scores of one round: the episodes' rewards, plus the reward model's, plus the
    judge's, plus the reward function's, plus the reward service's (reward_url), plus the
    overlong penalty; and the reward function's, the judge's, the service's and the
    environment's metrics. Validation scores with the episodes' rewards, the reward function
    and the service only. A sample that any source failed to score (an episode dropped by
    on_env_error=drop, a judge verdict not read, a reward call timed out or a service batch
    failed) has no score (NaN) and its first failure as its reason (unless the source's
    `rewards` term weighs 0: it adds nothing to the score); each source's metric is over the
    samples it scored."""
    score = torch.zeros(len(samples))
    metrics = dict(answers.metrics)
    failed: list[str | None] = [None] * len(samples)

    def fail(reasons: list[str | None]) -> None:
        for i, reason in enumerate(reasons):
            failed[i] = failed[i] or reason

    def log_mean(key: str, values: torch.Tensor, reasons: list[str | None]) -> None:
        own = [float(v) for v, r in zip(values, reasons) if r is None]
        if own:  # a round where the source scored nothing reports nothing
            metrics[key] = sum(own) / len(own)

    if answers.episodes is not None:
        score += torch.tensor([e.reward for e in answers.episodes])
        fail([e.error for e in answers.episodes])
    if config.reward_model and not validation:
        batch = rollout_batch([list(p.ids) for p in answers.prompts],
                              answers.completions).sequences
        rm = workers.experience(batch, frozenset({"reward"}))["rm_scores"].float()
        term = next((t for t in config.rewards if t.kind == "reward_model"), None)
        score += rm * (term.weight if term else 1.0)
        if term:
            metrics[f"reward/{term.name}"] = float(rm.mean())
    judged_rows = None
    if data.judge is not None and not validation:
        judged = data.judge.score(workers.judge, answers.prompts, samples, step)
        term = next((t for t in config.rewards if t.kind == "judge"), None)
        score += judged.scores * (term.weight if term else 1.0)
        if term is None or term.weight:  # a term of weight 0 scores nothing to fabricate
            fail(judged.failed)
        metrics.update(judged.metrics)
        if term:
            log_mean(f"reward/{term.name}", judged.scores, judged.failed)
        judged_rows = [{"judge": text, "judge_score": float(value) if why is None else None}
                       for text, value, why in zip(judged.texts, judged.scores, judged.failed)]
    for s in data.scorers:
        values, fn_metrics, fn_failed = s.scorer.score(step, samples)
        score += s.weight * values
        if s.weight:
            fail(fn_failed)
        for key, value in fn_metrics.items():  # several functions' counts add up
            metrics[key] = metrics.get(key, 0.0) + value if key in COUNT_METRICS else value
        if s.name is not None:
            log_mean(f"reward/{s.name}", values, fn_failed)
    buffer = config.options.overlong_buffer
    if buffer and not validation:
        lengths = torch.tensor([len(c.token_ids) for c in answers.completions])
        penalty = overlong_penalty(lengths, max_len=config.max_new_tokens, buffer=buffer,
                                   factor=config.overlong_penalty)
        score += penalty
        metrics["reward/overlong_penalty"] = float(penalty.mean())
    score[~scored_mask(failed)] = math.nan
    return Scored(score, metrics, judged_rows, failed)


def scored_mask(failed: list[str | None]) -> torch.Tensor:
    """[B] bool: the samples `failed` gives no reason for."""
    return torch.tensor([f is None for f in failed], dtype=torch.bool)


def check_failures(config: PPOConfig, failed: list[str | None], where: str) -> None:
    """Stop the run when more than max_failed_reward_fraction of `failed`'s samples have no
    score: their rewards would say more about the scorers than about the policy."""
    reasons = [f for f in failed if f is not None]
    if len(reasons) > config.max_failed_reward_fraction * len(failed):
        bound = config.max_failed_reward_fraction
        raise RewardFnError(f"{where}: {len(reasons)} of {len(failed)} samples have no score "
                            f"(more than max_failed_reward_fraction={bound}); last failure: "
                            f"{reasons[-1]}")


COUNT_METRICS = ("reward/timeouts", "reward/worker_restarts", "reward/url_failed_samples",
           "reward/url_retries",
           "reward/url_seconds", "reward/judge_parse_failures", "reward/judge_seconds",
           "env/errors", "env/tool_errors", "env/observations_cut", "agent/errors",
           "agent/untrained_completions", "agent/seconds",
           "env/seconds")
"""Metrics of a round that are totals (the step's is their sum over rounds)."""


def merge_metrics(scored: list[tuple[int, dict[str, float]]]) -> dict[str, float]:
    """The reward and environment metrics of every sample scored this step (all rounds,
    dropped groups too): totals add up, the longest episode is the longest of any round; the
    others are means over the rounds that reported them, weighted by their samples."""
    out = {}
    for key in sorted({key for _, metrics in scored for key in metrics}):
        rounds = [(count, m[key]) for count, m in scored if key in m]
        if key in COUNT_METRICS:
            out[key] = sum(value for _, value in rounds)
        elif key == "env/turns_max":
            out[key] = max(value for _, value in rounds)
        else:
            out[key] = sum(c * v for c, v in rounds) / sum(c for c, _ in rounds)
    return out
