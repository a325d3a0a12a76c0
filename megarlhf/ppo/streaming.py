"""Fully asynchronous rollouts (rollout_mode=fully_async, disaggregated): the rollout engines
never wait for the trainer.

A producer thread keeps the engines busy. Each of its engine calls gives every sample in
flight up to partial_rollout_tokens more tokens (a sample continues from its prompt and the
tokens it has, under whatever weights the engines hold then), and starts new prompts
(samples_per_prompt samples each) when the staleness bound leaves room. A group whose samples
have all finished goes to a scorer thread, which scores it while the engines go on with the
others (a judge, a reward model or a reward service answers beside the generation), and
joins the buffer. Each step takes prompts_per_step groups from the buffer, oldest weights
first, as soon as it holds them. With an environment, the producer runs batches of episodes
instead, each turn one engine call (`_episodes`).

The weight sync waits for the call in progress (`paused`), so a call runs under one weight
version and every token records it: a sample's tokens may span versions (a partial rollout),
each with the engine's own logprob, so rollout correction weighs them token by token. A
group's age is its oldest token's: one started at version v trains at step s with lag
s - 1 - v, so step v + 1 + max_staleness is the last that may train it. The producer starts
a group only if the steps up to then can still take it beside the groups held. A group that
finishes late (long samples take more calls) is waited for by the last step allowed to train
it (stale_groups=wait: steps train long answers as often as short ones), or (stale_groups=
drop) left to the younger groups that finished first and dropped once it would lag more.

Timing decides which tokens fall under which version, so a run is not repeatable bitwise.
A checkpoint keeps the groups in flight and in the buffer (`snapshot`, taken between two
calls with the sampler's position), and a resumed run continues them: its first step trains
on the groups the checkpoint buffered.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import functools
import logging
import math
import threading
import time

from megarlhf.data.prompts import Prompt
from megarlhf.envs.episodes import Episode
from megarlhf.ppo.config import PPOConfig
from megarlhf.ppo.inputs import RunInputs
from megarlhf.ppo.placement import Placement
from megarlhf.ppo.rollouts import (
    COUNT_METRICS, Answers, Group, StepRollout, assemble, check_failures, merge_metrics,
    sampling, score_answers,
)
from megarlhf.rl.shaping import varied_groups
from megarlhf.rollout.engine import Completion

_log = logging.getLogger(__name__)

_CALL_SEED = 2**46
"""Offsets the producer's calls' sampling seeds from the other rollouts' (see gap_probe)."""
_CALLS_PER_VERSION = 2**20
"""A fresh stream at weight version v counts its calls from v * this."""


@dataclasses.dataclass
class Partial:
    """One sample as far as it has been generated."""

    key: int
    """Its engine key: every call sends it to the engine that holds its prefix."""
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    """Per token, the weight version it was sampled under."""
    finish_reason: str | None = None
    """None while it is still generating."""


@dataclasses.dataclass
class Started:
    """A group in flight: one prompt's samples."""

    prompt: Prompt
    samples: list[Partial]
    version: int
    """The weight version of its first tokens (its oldest)."""


@dataclasses.dataclass
class Scoring:
    """A finished group on its way to the buffer."""

    group: Started
    completions: list[Completion]
    episodes: list[Episode] | None
    versions: list[list[int]]
    metrics: dict[str, float]
    """The environment's, once per batch of episodes."""


class _Stopped(Exception):
    """The run ended while episodes were running (they are dropped)."""


@dataclasses.dataclass
class Finished:
    """A group in the buffer, scored."""

    group: Group
    versions: list[list[int]]
    oldest: int
    metrics: dict[str, float]
    """Its scoring's metrics (merged over a step's groups as rounds are)."""
    varied: bool = True
    """Its scores are not all equal (dynamic sampling keeps only such groups while it may)."""


@dataclasses.dataclass
class StreamState:
    """What a checkpoint keeps of the stream."""

    in_flight: list[Started]
    buffer: list[Finished]
    calls: int
    """Engine calls so far: each call's sampling seed."""
    next_key: int


class Stream:
    """The fully asynchronous counterpart of rollouts.Rollouts, with the same methods for the
    controller (see the module doc)."""

    def __init__(self, config: PPOConfig, data: RunInputs, workers: Placement, sampler, *,
                 weight_version: int, pending: StreamState | None = None):
        self.config, self.data, self.workers, self.sampler = config, data, workers, sampler
        self.weight_version = weight_version
        """The updates the engine's weights hold now."""
        # A fresh stream (also one whose kept state was refused) seeds its calls apart from
        # those of the steps before.
        state = pending or StreamState([], [], weight_version * _CALLS_PER_VERSION, 0)
        self._in_flight, self._buffer = state.in_flight, state.buffer
        self._calls, self._next_key = state.calls, state.next_key
        self._taken = weight_version  # the last step that took its groups
        self._dropped = 0  # stale groups dropped since the last step took its groups
        self._dropped_lengths: list[int] = []  # ... their samples' lengths (so far)
        self._filtered = 0  # dynamic sampling: equal-score groups dropped since then
        self._filtered_failed: list[str | None] = []  # ... their samples' failures
        self._cond = threading.Condition()  # guards the state; not held during a call
        self._thread: threading.Thread | None = None
        self._scorer: threading.Thread | None = None
        # Finished groups not yet in the buffer, a call's together (the first being scored).
        self._to_score: collections.deque[list[Scoring]] = collections.deque()
        self._scoring_call = False  # the scorer is inside a scoring call
        self._stopping = False
        self._pausing = False  # the controller waits for the engines to idle (a sync)
        self._holding = False  # ... for everything to idle (a snapshot, a validation)
        self._calling = False  # an engine call runs
        self._running: list[Started] = []  # the groups of the batch of episodes that runs
        self._error: BaseException | None = None
        self._raised = False  # a step raised _error

    # -- the controller's side ---------------------------------------------------------------

    def take(self, step: int) -> StepRollout:
        """Step `step`'s groups, oldest weights first, once the buffer holds enough and
        (stale_groups=wait) no older group still generating or being scored is owed to this
        step (`_owed`)."""
        n = self.config.prompts_per_step
        wait = self.config.stale_groups == "wait"
        start = time.perf_counter()
        full = None  # when the buffer held enough groups but older ones were owed
        with self._cond:
            while True:
                if self._error is not None:
                    self._raised = True
                    raise self._error
                self._drop_stale(step)
                if len(self._buffer) >= n:
                    if not (wait and self._owed(step)):
                        break
                    full = full or time.perf_counter()
                self._start()
                self._cond.wait()
            self._start()  # after a resume: once the step took the kept buffer's groups
            self._buffer.sort(key=lambda f: f.oldest)  # stable: in finishing order otherwise
            chosen, self._buffer = self._buffer[:n], self._buffer[n:]
            self._taken, dropped, self._dropped = step, self._dropped, 0
            dropped_lengths, self._dropped_lengths = self._dropped_lengths, []
            filtered, self._filtered = self._filtered, 0
            filtered_failed, self._filtered_failed = self._filtered_failed, []
            buffered = len(self._buffer)
            self._cond.notify_all()  # room for more groups
        end = time.perf_counter()
        waited = end - start
        versions = [v for f in chosen for v in f.versions]
        completions = [c for f in chosen for c in f.group.answers.completions]
        lags = [step - 1 - v for sample, c in zip(versions, completions)  # sampled tokens'
                for v, sampled in zip(sample, c.sampled or [True] * len(sample)) if sampled
                ] or [step - 1 - min(f.oldest for f in chosen)]
        metrics = {**merge_metrics([(len(f.versions), f.metrics) for f in chosen]),
                   "rollout/policy_lag_mean": sum(lags) / len(lags),
                   "rollout/policy_lag_max": float(max(lags)),
                   "rollout/stale_dropped": float(dropped),
                   "rollout/buffer_groups": float(buffered)}
        if wait:  # a metric, not a phase: time/rollout holds it already
            metrics["time/staleness_wait"] = end - full if full is not None else 0.0
        else:  # the length bias dropping costs: late groups are the long ones
            trained = [len(c.token_ids) for c in completions]
            metrics.update({
                "rollout/trained_length_mean": sum(trained) / len(trained),
                "rollout/stale_dropped_length_mean": sum(dropped_lengths) / len(
                    dropped_lengths) if dropped_lengths else math.nan})
        if self.config.options.dynamic_sampling:
            metrics.update({"rollout/dynamic_sampling_dropped": float(filtered),
                            "rollout/dynamic_sampling_short": float(
                                sum(not f.varied for f in chosen))})
        drawn = assemble(self.data, [f.group for f in chosen], metrics, {"rollout": waited},
                         min(f.oldest for f in chosen), versions)
        # Dynamic sampling drops a group with fewer than two scores as one without variance:
        # the bound counts those too, so dropping cannot hide a failing scorer.
        check_failures(self.config, drawn.failed + filtered_failed, f"step {step}")
        return drawn

    def finish(self) -> None:
        """Nothing to wait for: the sync pauses the producer instead (`paused`)."""

    @contextlib.contextmanager
    def paused(self):
        """The engines idle between two of the producer's calls (for the weight sync; with
        an environment, between two turns of the episodes); the producer starts no call
        until this ends."""
        with self._cond:
            self._pausing = True
            while self._calling:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._pausing = False
                self._cond.notify_all()

    @contextlib.contextmanager
    def idle(self):
        """Nothing of the producer's or the scorer's runs (for a checkpoint's snapshot, and
        for validation, which shares the reward function's and the environments' workers):
        the running episodes end and every finished group is scored first."""
        with self._cond:
            self._holding = True
            while (self._calling or self._running or self._to_score) and self._error is None:
                self._cond.wait()
            if self._error is not None:  # a thread failed: what it left will never finish
                self._holding, self._raised = False, True
                raise self._error
        try:
            yield
        finally:
            with self._cond:
                self._holding = False
                self._cond.notify_all()

    def synced(self, step: int) -> None:
        """The engines hold the weights of version `step` (call while `paused`)."""
        with self._cond:
            self.weight_version = step
            self._drop_stale(self._taken + 1)  # no room kept for groups no step can take

    def snapshot(self) -> tuple[dict, StreamState]:
        """The sampler's state and the stream's, between two calls."""
        with self.idle():
            return self.sampler.state_dict(), copy.deepcopy(StreamState(
                self._in_flight, self._buffer, self._calls, self._next_key))

    def overlap(self) -> None:
        """The engines run beside every phase: no span of their own."""

    def stop(self) -> None:
        """End the producer and the scorer after their calls in progress (the run's last
        step is done)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._join()

    def drawing(self) -> bool:
        """After a failed step: the producer and the scorer start no further call; whether
        one is inside one."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            return self._calling or self._scoring_call

    def close(self) -> None:
        """Join the threads (after the workers' shutdown, which ends a call they wait on)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._join()
        if self._error is not None and not self._raised:
            _log.error("the rollout stream failed too: %r", self._error)

    # -- the producer ------------------------------------------------------------------------

    def _start(self) -> None:
        if self._thread is None and not self._stopping:
            self._thread = threading.Thread(target=self._produce, daemon=True,
                                            name="rollout-stream")
            self._scorer = threading.Thread(target=self._score_finished, daemon=True,
                                            name="rollout-scorer")
            self._thread.start()
            self._scorer.start()

    def _join(self) -> None:
        for thread in (self._thread, self._scorer):
            if thread is not None:
                thread.join()
        self._thread = self._scorer = None

    def _produce(self) -> None:
        """Engine calls (or batches of episodes) until `stop`, each outside the lock (the
        controller may take groups meanwhile), flagged by `_calling`; what a call finished
        goes to the scorer."""
        try:
            while True:
                with self._cond:
                    while not self._stopping and self._error is None and (
                            self._pausing or self._holding or not (
                                self._in_flight or self._room())):
                        self._cond.wait()
                    if self._stopping or self._error is not None or \
                            self._taken >= self.config.steps:
                        return  # (the last step took its groups: the rest would go unused)
                    started = []
                    while self._room():
                        started.append(self._start_group())
                        if self.data.episodes is None:
                            self._in_flight.append(started[-1])
                        else:
                            self._running.append(started[-1])
                    seed = self._calls
                    self._calls += 1
                    self._calling = True
                if self.data.episodes is None:
                    done = self._advance(seed)
                else:
                    done = self._episodes(started, seed)
                with self._cond:
                    if done:
                        self._to_score.append(done)
                    self._running = []
                    self._calling = False
                    self._cond.notify_all()
        except _Stopped:
            with self._cond:
                self._calling, self._running = False, []
                self._cond.notify_all()
        except BaseException as error:  # the step waiting in `take` raises it
            with self._cond:
                self._error = self._error or error  # the first failure is the cause
                self._calling, self._running = False, []
                self._cond.notify_all()

    def _score_finished(self) -> None:
        """Score what the producer's calls finished, a call's groups together and in the
        order they finished, for the step that will take them next; into the buffer."""
        try:
            while True:
                with self._cond:
                    while not self._stopping and not self._to_score:
                        self._cond.wait()
                    if self._stopping:
                        return
                    done, step = self._to_score[0], self._taken + 1
                    self._scoring_call = True
                scored = self._score(done, step)
                with self._cond:
                    self._to_score.popleft()
                    self._buffer += self._filter(scored)
                    self._scoring_call = False
                    self._cond.notify_all()
        except BaseException as error:  # the step waiting in `take` raises it
            with self._cond:
                self._error, self._scoring_call = self._error or error, False
                self._to_score.clear()
                self._cond.notify_all()

    def _room(self) -> bool:
        """Whether a new group, started now, could still train within the staleness bound:
        the steps up to weight_version + 1 + max_staleness not yet given their groups would
        take more than those in flight, being scored and buffered."""
        last = min(self.weight_version + 1 + self.config.max_staleness, self.config.steps)
        wanted = self.config.prompts_per_step * (last - self._taken)
        unscored = sum(map(len, self._to_score))
        held = len(self._in_flight) + len(self._running) + unscored + len(self._buffer)
        return held < wanted

    def _owed(self, step: int) -> bool:
        """stale_groups=wait: whether step `step` must wait for groups not yet in the
        buffer (generating, or being scored) so that none outlives max_staleness.

        A group of version v may train up to step v + 1 + max_staleness, its last. Were the
        unbuffered groups, oldest first, all that the next steps took, the k-th (from 0)
        would train at step + 1 + k // prompts_per_step at the earliest: the step waits
        while one would come after its last. That holds it for every group due now (this
        step is its last), and with max_staleness >= 2 for some due later too: the engines
        may hold several steps' groups of one version (max_staleness + 1 at the start), and
        a step that took younger, shorter ones in their place would leave more of them than
        the next steps can train in time.

        Why, at each step, the groups due by any step k are then at most prompts_per_step x
        (k - the last step taken), so that those due now fit in this step's batch and are in
        it (oldest first): `_room` starts a group due by k only while the groups held, none
        younger, are fewer than that; and a step takes either prompts_per_step groups due by
        k, or every buffered one due by k, leaving only unbuffered ones, which this wait
        keeps to what the steps after it up to k take. A group of episodes counts by the
        version it started under until it is scored (its oldest token's may be newer: the
        wait errs early). Groups a checkpoint kept under stale_groups=drop may be more;
        `_drop_stale` drops what would outlive the bound."""
        n, s = self.config.prompts_per_step, self.config.max_staleness
        versions = sorted([g.version for g in self._in_flight + self._running]
                          + [_oldest(d) for call in self._to_score for d in call])
        return any(v + s < step + k // n for k, v in enumerate(versions))

    def _start_group(self) -> Started:
        (prompt,) = self.sampler.next(1)
        samples = [Partial(key=self._next_key + i)
                   for i in range(self.config.samples_per_prompt)]
        self._next_key += len(samples)
        return Started(prompt, samples, self.weight_version)

    def _advance(self, seed: int) -> list[Scoring]:
        """One engine call: up to partial_rollout_tokens more tokens for each unfinished
        sample in flight, continuing from its prompt and its tokens so far; the groups it
        finished."""
        c = self.config
        with self._cond:
            live = [(g, s) for g in self._in_flight for s in g.samples
                    if s.finish_reason is None]
            version = self.weight_version
        per_call = c.partial_rollout_tokens or c.max_new_tokens
        limits = [min(per_call, c.max_new_tokens - len(s.tokens)) for _, s in live]
        params = dataclasses.replace(self._params(seed, n=1), max_new_tokens=max(limits),
                                     max_new_tokens_each=tuple(limits))
        completions = self.workers.rollout([list(g.prompt.ids) + s.tokens for g, s in live],
                                           params, keys=[s.key for _, s in live])
        self.workers.take_busy()  # the producer's calls belong to no step's timings
        with self._cond:
            for (_, sample), limit, out in zip(live, limits, completions):
                sample.tokens += out.token_ids
                sample.logprobs += out.logprobs
                sample.versions += [version] * len(out.token_ids)
                # Fewer tokens than asked without a stop: the engine's context is full; the
                # sample ends there ('length').
                if out.finish_reason == "stop" or len(out.token_ids) < limit or \
                        len(sample.tokens) >= c.max_new_tokens:
                    sample.finish_reason = out.finish_reason
            done = [g for g in self._in_flight
                    if all(s.finish_reason is not None for s in g.samples)]
            self._in_flight = [g for g in self._in_flight if not any(g is d for d in done)]
        return [Scoring(g, [Completion(prompt_index=0, token_ids=s.tokens,
                                       logprobs=s.logprobs, finish_reason=s.finish_reason)
                            for s in g.samples], None, [s.versions for s in g.samples], {})
                for g in done]

    def _episodes(self, groups: list[Started], seed: int) -> list[Scoring]:
        """The groups' episodes, run to their end (environment state cannot be kept in a
        checkpoint); each turn is one engine call, and a weight sync may come between two
        turns, so an episode's turns may be of several versions."""
        turns = collections.defaultdict(list)  # episode key: (version, tokens) per turn
        episodes, metrics = self.data.episodes.run(
            [g.prompt for g in groups], self._params(seed, n=self.config.samples_per_prompt),
            functools.partial(self._turn, turns))
        n = self.config.samples_per_prompt
        out = []
        for i, g in enumerate(groups):
            mine = episodes[i * n:(i + 1) * n]
            out.append(Scoring(g, [e.completion for e in mine], mine,
                               [_episode_versions(e, turns[i * n + j])
                                for j, e in enumerate(mine)],
                               metrics if i == 0 else {}))
        return out

    def _claim(self) -> None:
        """Mark the producer busy (`_calling`) again, once no sync waits and the run goes
        on (between turns of episodes, it lets the controller's calls in)."""
        with self._cond:
            self._calling = False
            self._cond.notify_all()
            while self._pausing and not self._stopping:
                self._cond.wait()
            if self._stopping:
                raise _Stopped()
            self._calling = True

    def _turn(self, turns: dict, prompts: list[list[int]], params, keys: list[int]
              ) -> list[Completion]:
        """One turn of every live episode: a call under one weight version, after any sync
        the controller waits to make."""
        self._claim()
        with self._cond:
            version = self.weight_version
        completions = self.workers.rollout(prompts, params, keys)
        self.workers.take_busy()
        for key, c in zip(keys, completions):
            turns[key].append((version, len(c.token_ids)))
        with self._cond:
            self._calling = False  # the environments' steps run next
            self._cond.notify_all()
        return completions

    def _params(self, seed: int, *, n: int):
        c = self.config
        return sampling(c, self.data, n=n, temperature=c.temperature,
                        seed=c.seed * 1_000_003 + _CALL_SEED + seed)

    def _score(self, done: list[Scoring], step: int) -> list[Finished]:
        """The finished groups scored together, for `step` (the next to take groups)."""
        n = self.config.samples_per_prompt
        episodes = [e for d in done for e in d.episodes] if done[0].episodes else None
        metrics = {}
        for d in done:
            metrics.update(d.metrics)
        # An episode's prompt holds what its environment's reset added.
        answers = Answers([e.prompt for e in episodes] if episodes else
                          [d.group.prompt for d in done for _ in range(n)],
                          [dataclasses.replace(c, prompt_index=row) for row, c in
                           enumerate(c for d in done for c in d.completions)],
                          episodes, metrics)
        samples = self.data.samples(answers.prompts, answers.completions, episodes)
        scored = score_answers(self.config, self.data, self.workers, answers, samples, step)
        # Each group carries an equal share of the call's totals (steps may take its groups
        # apart); its means hold for every group.
        share = {key: value / len(done) if key in COUNT_METRICS else value
                 for key, value in scored.metrics.items()}
        varied = varied_groups(scored.score, n, scored.scored()).tolist()
        judged = scored.judged
        return [Finished(Group(answers.rows(rows), samples[rows], scored.score[rows],
                               judged[rows] if judged is not None else None,
                               scored.failed[rows]),
                         d.versions, _oldest(d), share, varied[i])
                for i, d, rows in ((i, d, slice(i * n, (i + 1) * n))
                                   for i, d in enumerate(done))]

    def _filter(self, scored: list[Finished]) -> list[Finished]:
        """Dynamic sampling (DAPO): a group whose samples all scored the same teaches nothing
        and is dropped, up to dynamic_sampling_rounds x prompts_per_step groups per step (as
        many as the synchronous modes' extra rounds would draw); past that, such groups
        complete the batch (rollout/dynamic_sampling_short)."""
        if not self.config.options.dynamic_sampling:
            return scored
        budget = self.config.dynamic_sampling_rounds * self.config.prompts_per_step
        kept = []
        for f in scored:
            if f.varied or self._filtered >= budget:
                kept.append(f)
            else:
                self._filtered += 1
                self._filtered_failed += f.group.failed
        return kept

    def _drop_stale(self, step: int) -> None:
        """Drop the groups that step `step` or any later one would train beyond
        max_staleness (in the buffer, and in flight: they would only finish to be
        dropped). With stale_groups=wait the steps take each group in time (`_owed`), so
        only groups a checkpoint kept under stale_groups=drop (or before it) could be."""
        def fresh(oldest: int) -> bool:
            return step - 1 - oldest <= self.config.max_staleness

        late = [f for f in self._buffer if not fresh(f.oldest)]
        cut = [g for g in self._in_flight if not fresh(g.version)]
        if late or cut:
            self._buffer = [f for f in self._buffer if fresh(f.oldest)]
            self._in_flight = [g for g in self._in_flight if fresh(g.version)]
            self._dropped += len(late) + len(cut)
            # What they held (in flight: so far), to set beside what trains: the groups
            # that finish late are those with long samples.
            self._dropped_lengths += [len(c.token_ids) for f in late
                                      for c in f.group.answers.completions]
            self._dropped_lengths += [len(s.tokens) for g in cut for s in g.samples]
            self._cond.notify_all()  # room for new groups (the producer may be idle)


def _oldest(scoring: Scoring) -> int:
    """A group's age: its oldest token's version (an episode's reset may have waited out a
    sync, so its first turn can be newer than the group's start)."""
    versions = [v for sample in scoring.versions for v in sample]
    return min(versions) if versions else scoring.group.version


def _episode_versions(episode: Episode, turns: list[tuple[int, int]]) -> list[int]:
    """Per token of an episode, the weight version of its turn (an observation: of the turn
    before it), from the (version, tokens) of each of its engine calls in order: through
    the call each token names (Episode.engine_calls, an agent's), else turn by turn."""
    if episode.engine_calls is not None:
        return [turns[call][0] for call in episode.engine_calls]
    completion = episode.completion
    sampled = completion.sampled or (True,) * len(completion.token_ids)
    out, i = [], 0
    for version, count in turns:
        out += [version] * count
        i += count
        while i < len(sampled) and not sampled[i]:
            out.append(version)
            i += 1
    if i != len(sampled):
        raise RuntimeError(f"an episode's turns account for {i} of its {len(sampled)} tokens")
    return out
