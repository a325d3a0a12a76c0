"""The fully asynchronous rollout stream (ppo/streaming.py) against a scripted engine, in
threads: the engine's tokens say what the stream must have asked for, so every bookkeeping
rule is checked against values the engine wrote independently of the stream.

The scripted engine answers sample `key` with tokens 0, 1, 2, ... up to a length fixed by the
key, each with logprob -(the weight version it holds), and checks that each call continues a
sample from exactly the tokens it has (a partial rollout), and that no call runs during a
weight sync."""

from __future__ import annotations

import copy
import dataclasses
import math
import threading
import time
import types

import pytest
import torch

from megarlhf.data.prompts import Prompt
from megarlhf.ppo import streaming
from megarlhf.ppo.data import PromptSampler
from megarlhf.ppo.rollouts import Scored
from megarlhf.rewards.calls import Sample
from megarlhf.rollout.engine import Completion

MAX = 8  # max_new_tokens


def _length(key: int) -> int:
    return 1 + (key * 5) % MAX


class ScriptedEngine:
    def __init__(self, delay: float, length=None):
        self.delay, self.version, self.syncing, self.calls = delay, 0, False, 0
        self.length = length or (lambda key, prompt: _length(key))
        """A sample's length from its key and its prompt's id."""

    def rollout(self, prompts, params, keys):
        assert not self.syncing, "an engine call during a weight sync"
        self.calls += 1
        out = []
        for row, (ids, key, limit) in enumerate(zip(prompts, keys,
                                                     params.max_new_tokens_each)):
            so_far, length = ids[1:], self.length(key, ids[0])  # prompts are one token long
            assert so_far == list(range(len(so_far))), (key, ids)
            assert len(so_far) < length and limit >= 1
            new = list(range(len(so_far), min(len(so_far) + limit, length)))
            out.append(Completion(prompt_index=row, token_ids=new,
                                  logprobs=[-float(self.version)] * len(new),
                                  finish_reason="stop" if len(so_far) + len(new)
                                  == length else "length"))
        time.sleep(self.delay)
        return out

    def take_busy(self):
        return {}


def _reward(prompt, completion) -> float:
    """Length, except on every third prompt, where every sample scores 0."""
    return 0.0 if prompt.ids[0] % 3 == 0 else float(len(completion.token_ids))


def _score(config, data, workers, answers, samples, step):
    """_reward; one timeout per scoring call (a count metric)."""
    score = torch.tensor([_reward(answers.prompts[c.prompt_index], c)
                          for c in answers.completions])
    return Scored(score, {"reward/timeouts": 1.0, "reward/length": float(score.mean())}, None,
                  [None] * len(score))


def _stream(monkeypatch, *, steps, staleness, per_call, delay, version=0, pending=None,
            sampler=None, score=_score, dynamic_rounds=None, stale_groups="wait", length=None):
    monkeypatch.setattr(streaming, "score_answers", score)
    config = types.SimpleNamespace(
        prompts_per_step=2, samples_per_prompt=3, max_staleness=staleness, steps=steps,
        stale_groups=stale_groups, max_failed_reward_fraction=0.05,
        partial_rollout_tokens=per_call, max_new_tokens=MAX, temperature=1.0, seed=1,
        top_p=1.0, top_k=0, dynamic_sampling_rounds=dynamic_rounds or 0,
        options=types.SimpleNamespace(dynamic_sampling=dynamic_rounds is not None))
    data = types.SimpleNamespace(
        checked=types.SimpleNamespace(stop_token_ids=()), episodes=None, judge=None,
        samples=lambda prompts, completions, episodes=None: [
            Sample(prompt=None, response=None, prompt_ids=list(prompts[c.prompt_index].ids),
                   response_ids=c.token_ids)
            for c in completions])
    sampler = sampler or PromptSampler([Prompt(ids=(1000 + i,), where=f"p{i}")
                                        for i in range(64)], seed=0)
    engine = ScriptedEngine(delay, length)
    engine.version = version
    return streaming.Stream(config, data, engine, sampler, weight_version=version,
                            pending=pending), engine


def _train(stream, engine, first, last, train_s):
    """Steps first..last as the controller runs them; each step's rollout."""
    drawn = []
    for step in range(first, last + 1):
        d = stream.take(step)
        drawn.append(d)
        time.sleep(train_s)
        with stream.paused():
            engine.syncing = True
            time.sleep(0.002)
            engine.version = step
            stream.synced(step)
            engine.syncing = False
    return drawn


def _check(step, d, staleness):
    """Every token carries the version the engine sampled it under; the lag metrics over
    tokens; whole groups; the staleness bound."""
    n = 3
    assert len(d.completions) == 2 * n
    for row, c in enumerate(d.completions):
        assert c.token_ids == list(range(len(c.token_ids)))
        assert c.logprobs == [-float(v) for v in d.versions[row]]
        assert d.prompts[row] == d.prompts[row - row % n]  # a group's samples in a row
    lags = [step - 1 - v for sample in d.versions for v in sample]
    assert d.metrics["rollout/policy_lag_mean"] == pytest.approx(sum(lags) / len(lags))
    assert d.metrics["rollout/policy_lag_max"] == max(lags) <= staleness
    assert d.weight_version == min(min(v) for v in d.versions)
    assert d.score.tolist() == [_reward(d.prompts[row], c) for row, c in
                                enumerate(d.completions)]


def test_partial_rollouts_keep_each_tokens_version_within_the_bound(monkeypatch):
    """A slow engine (4 calls per 8-token sample) beside a fast trainer: syncs land in the
    middle of samples, which continue under the new weights; each token keeps its version.
    Scoring totals are shared out over a call's groups, so a step's sum over its groups is
    a fraction of calls and the run's total is the number of scoring calls."""
    stream, engine = _stream(monkeypatch, steps=6, staleness=1, per_call=2, delay=0.03)
    drawn = _train(stream, engine, 1, 6, train_s=0.005)
    stream.stop()
    assert stream._error is None
    for step, d in enumerate(drawn, start=1):
        _check(step, d, staleness=1)
    spans = [len(set(v)) for d in drawn for v in d.versions]
    assert max(spans) > 1, "no sample continued across a weight sync"
    assert max(d.metrics["rollout/policy_lag_max"] for d in drawn) == 1
    prompts = [p.ids for d in drawn for p in d.prompts[::3]]
    assert len(set(prompts)) == len(prompts) == 12  # each prompt trained once


def test_staleness_zero_samples_only_the_weights_it_trains(monkeypatch):
    """max_staleness=0: the stream starts a step's groups only after the sync before it,
    so every token is of the actor's own weights (lag 0), however fast the engine."""
    stream, engine = _stream(monkeypatch, steps=4, staleness=0, per_call=3, delay=0.0)
    drawn = _train(stream, engine, 1, 4, train_s=0.02)
    stream.stop()
    assert stream._error is None
    for step, d in enumerate(drawn, start=1):
        _check(step, d, staleness=0)
        assert d.weight_version == step - 1
        assert d.metrics["rollout/stale_dropped"] == 0


def _idle(stream):
    """Wait until the producer has nothing left to run (it finished what was in flight, and
    the bound leaves it no room to start more: between two calls it may otherwise look idle
    for a moment before it starts the next groups)."""
    deadline = time.monotonic() + 30
    while stream._in_flight or stream._calling or stream._to_score or stream._room():
        assert time.monotonic() < deadline, "the producer did not finish its groups"
        time.sleep(0.005)


def test_a_snapshot_resumes_with_its_buffer_first(monkeypatch):
    """A snapshot of an idle producer with a full buffer: a new stream from it (as a resumed
    run builds) trains first on the buffered groups, oldest first, before it generates."""
    stream, engine = _stream(monkeypatch, steps=6, staleness=2, per_call=1, delay=0.0)
    before = _train(stream, engine, 1, 2, train_s=0.0)
    _idle(stream)
    position, kept = stream.snapshot()
    stream.stop()
    assert stream._error is None
    assert len(kept.buffer) == 6 and not kept.in_flight  # 3 steps' worth: versions 1 and 2
    sampler = PromptSampler([Prompt(ids=(1000 + i,), where=f"p{i}") for i in range(64)],
                            seed=0)
    sampler.load_state_dict(position)
    resumed, engine = _stream(monkeypatch, steps=6, staleness=2, per_call=1, delay=0.0,
                              version=2, pending=copy.deepcopy(kept), sampler=sampler)
    drawn = _train(resumed, engine, 3, 4, train_s=0.0)
    resumed.stop()
    assert resumed._error is None
    for step, d in enumerate(drawn, start=3):
        _check(step, d, staleness=2)
    oldest_first = sorted(kept.buffer, key=lambda f: f.oldest)[:2]
    assert [c.token_ids for c in drawn[0].completions] == [
        c.token_ids for f in oldest_first for c in f.group.answers.completions]
    assert [p.ids for p in drawn[0].prompts] == [
        p.ids for f in oldest_first for p in f.group.answers.prompts]
    # Kept groups and any new ones are prompts steps 1-2 did not train (the sampler went on
    # from where the snapshot left it).
    assert not {p.ids for d in drawn for p in d.prompts} & {
        p.ids for d in before for p in d.prompts}


def test_a_kept_partial_sample_continues_from_its_tokens(monkeypatch):
    """A group in flight with 2 of its tokens sampled under version 0, resumed at version 1:
    the engine is asked to continue each sample from exactly those tokens (it checks), and
    the trained samples keep their first tokens' versions."""
    prompt = Prompt(ids=(1000,), where="p0")
    partial = streaming.Started(prompt, [streaming.Partial(key=key, tokens=[0, 1],
                                                           logprobs=[0.0, 0.0],
                                                           versions=[0, 0])
                                         for key in (3, 4, 5)], version=0)
    # keys 3, 4, 5 end at lengths 8, 5, 2: two continue, one had already ended at length 2
    partial.samples[2].finish_reason = "stop"
    stream, engine = _stream(monkeypatch, steps=3, staleness=1, per_call=2, delay=0.0,
                             version=1, pending=streaming.StreamState([partial], [], 7, 6))
    (d,) = _train(stream, engine, 2, 2, train_s=0.0)
    stream.stop()
    assert stream._error is None
    _check(2, d, staleness=1)
    rows = [row for row, p in enumerate(d.prompts) if p.ids == (1000,)]
    assert [len(d.completions[row].token_ids) for row in rows] == [8, 5, 2]
    assert [d.versions[row][:2] for row in rows] == [[0, 0]] * 3
    assert d.versions[rows[0]][2:] == [1] * 6


def test_a_stale_drop_wakes_an_idle_producer(monkeypatch):
    """The last step: a buffered group of version 0 is too old, the other is fine, and the
    producer is idle (its room was full). Dropping the old one makes room, and the step
    gets a new group instead of waiting forever."""
    stream, engine = _stream(monkeypatch, steps=1, staleness=1, per_call=MAX, delay=0.0)
    (d,) = _train(stream, engine, 1, 1, train_s=0.0)
    stream.stop()
    old, fine = _aged(_group(d), 0), _aged(_group(d), 2)
    late, engine = _stream(monkeypatch, steps=3, staleness=1, per_call=MAX, delay=0.0,
                           version=2, pending=streaming.StreamState([], [old, fine], 0, 10))
    late._start()
    time.sleep(0.05)  # the producer finds no room: in flight + buffered = 2 = what step 3 takes
    assert late._thread.is_alive() and not late._in_flight
    result = []
    taker = threading.Thread(target=lambda: result.append(late.take(3)), daemon=True)
    taker.start()
    taker.join(timeout=30)
    assert not taker.is_alive(), "the step waits forever for a group nobody generates"
    late.stop()
    assert late._error is None
    assert result[0].metrics["rollout/stale_dropped"] == 1 and engine.calls == 1


def test_stale_groups_drop_drops_late_groups_and_logs_their_lengths(monkeypatch):
    """stale_groups=drop, max_staleness=1, the engines at version 3: buffered, two copies of
    a long group (keys 3-5: 8, 5 and 2 tokens) of versions 0 and 1 and two of a short one
    (keys 0-2: 1, 6 and 3 tokens) of version 2; in flight, a group of version 1 with 3, 1
    and 2 tokens so far. Step 4 would train them at lags 3, 2, 1, 1 and 2: it drops the
    first two and the one in flight, and logs their 9 samples' mean length, (2 x 15 + 6) / 9
    = 4, beside the trained ones', 20 / 6."""
    stream, engine = _stream(monkeypatch, steps=2, staleness=1, per_call=MAX, delay=0.0)
    (d,) = _train(stream, engine, 1, 1, train_s=0.0)  # the first call's groups, in order
    stream.stop()
    assert [len(c.token_ids) for c in d.completions] == [_length(key) for key in range(6)] \
        == [1, 6, 3, 8, 5, 2]
    groups = [_aged(_group(d, 1), 0), _aged(_group(d, 1), 1), _aged(_group(d), 2),
              _aged(_group(d), 2)]
    cut = streaming.Started(Prompt(ids=(2000,), where="cut"), [
        streaming.Partial(key=key, tokens=list(range(count)), logprobs=[-1.0] * count,
                          versions=[1] * count) for key, count in ((3, 3), (4, 1), (5, 2))],
        version=1)
    late, engine = _stream(monkeypatch, steps=6, staleness=1, per_call=1, delay=0.0,
                           version=3, stale_groups="drop",
                           pending=streaming.StreamState([cut], groups, 0, 10_000))
    d = late.take(4)
    late.stop()
    assert late._error is None
    _check(4, d, staleness=1)
    assert d.metrics["rollout/stale_dropped"] == 3
    assert d.metrics["rollout/stale_dropped_length_mean"] == pytest.approx(4.0)
    assert d.metrics["rollout/trained_length_mean"] == pytest.approx(20 / 6)
    assert d.weight_version == 2 and d.metrics["rollout/policy_lag_max"] == 1


LONG = (1017, 1003, 1047, 1021, 1033, 1063)
"""Prompts answered with MAX tokens in the next test; the others with 1."""


def test_late_long_groups_are_waited_for_and_train_as_synchronously(monkeypatch):
    """The default stale_groups=wait, max_staleness=2, a token per call: the sampler draws
    1044, 1046, 1017, 1003, 1047, 1021 (version 0), 1035, 1006 (version 1), 1033, 1002,
    1063, 1019, ...; long answers take 8 calls, so the four long groups of version 0 finish
    behind the short ones of version 1 (dropping, step 2 would train those, and step 4 drop
    two of the long groups). No group is dropped, no trained token lags more than 2, and the
    steps train the answers the synchronous mode trains: the first 6 x 2 prompts'."""
    def length(key, prompt):
        return MAX if prompt in LONG else 1

    stream, engine = _stream(monkeypatch, steps=6, staleness=2, per_call=1, delay=0.01,
                             length=length)
    drawn = _train(stream, engine, 1, 6, train_s=0.0)
    stream.stop()
    assert stream._error is None
    for step, d in enumerate(drawn, start=1):
        _check(step, d, staleness=2)
        assert d.metrics["rollout/stale_dropped"] == 0 and d.metrics["time/staleness_wait"] >= 0
    synchronous = PromptSampler([Prompt(ids=(1000 + i,), where=f"p{i}") for i in range(64)],
                                seed=0).next(6 * 2)
    assert sorted(len(c.token_ids) for d in drawn for c in d.completions) == sorted(
        length(None, p.ids[0]) for p in synchronous for _ in range(3))


def test_a_step_waits_for_old_groups_a_later_step_could_not_all_train(monkeypatch):
    """max_staleness=2, after step 1: two short groups of version 1 buffered, four of
    version 0 still generating (6 to 7 more calls). Step 3 is the last that may train
    those four, and it takes two groups: step 2 waits (time/staleness_wait) until two of
    them finish and trains them rather than the buffered younger ones, and step 3 the other
    two; none dropped."""
    stream, engine = _stream(monkeypatch, steps=2, staleness=1, per_call=MAX, delay=0.0)
    (d,) = _train(stream, engine, 1, 1, train_s=0.0)
    stream.stop()
    young = [_aged(_group(d), 1), _aged(_group(d, 1), 1)]
    # keys 3-5, 9-11, 12-14 and 21-23: their samples end at 8, 5, 2; 6, 3, 8; 5, 2, 7; 2, 7, 4
    old = [streaming.Started(Prompt(ids=(2000 + key,), where="old"), [
        streaming.Partial(key=key + i, tokens=[0], logprobs=[0.0], versions=[0])
        for i in range(3)], version=0) for key in (3, 9, 12, 21)]
    resumed, engine = _stream(monkeypatch, steps=3, staleness=2, per_call=1, delay=0.01,
                              version=1, pending=streaming.StreamState(old, young, 0, 100))
    drawn = _train(resumed, engine, 2, 3, train_s=0.0)
    resumed.stop()
    assert resumed._error is None
    for step, d in enumerate(drawn, start=2):
        _check(step, d, staleness=2)
        assert d.weight_version == 0 and d.metrics["rollout/stale_dropped"] == 0
    assert drawn[0].metrics["time/staleness_wait"] > 0
    assert sorted(p.ids[0] for d in drawn for p in d.prompts[::3]) == [2003, 2009, 2012, 2021]


def _aged(template, version):
    """A copy of a buffered group as if sampled under `version` (its logprobs say so too)."""
    f = copy.deepcopy(template)
    f.oldest, f.versions = version, [[version] * len(v) for v in f.versions]
    f.group.answers.completions = [dataclasses.replace(
        c, logprobs=[-float(version)] * len(c.token_ids)) for c in f.group.answers.completions]
    return f


def _group(d, i=0):
    """Group `i` of a step's rollout `d`, as buffered with version 0."""
    from megarlhf.ppo.rollouts import Answers, Group
    rows = slice(3 * i, 3 * i + 3)
    return streaming.Finished(group=Group(Answers(d.prompts[rows], d.completions[rows], None,
                                                  {}), d.samples[rows], d.score[rows], None,
                                          [None] * 3),
                              versions=d.versions[rows], oldest=0, metrics={})


def test_dynamic_sampling_drops_equal_score_groups_within_its_budget(monkeypatch):
    """DAPO's filter as groups complete: every third prompt's samples all score 0. With a
    budget of 2 rounds x 2 prompts, the steps train only varied groups and count the
    dropped ones; with a budget of 0 rounds (nothing may be dropped) equal-score groups
    complete the batch and are counted short."""
    stream, engine = _stream(monkeypatch, steps=4, staleness=1, per_call=MAX, delay=0.0,
                             dynamic_rounds=2)
    drawn = _train(stream, engine, 1, 4, train_s=0.0)
    stream.stop()
    assert stream._error is None
    for step, d in enumerate(drawn, start=1):
        _check(step, d, staleness=1)
        assert d.metrics["rollout/dynamic_sampling_short"] == 0
        assert all(p.ids[0] % 3 for p in d.prompts)  # no equal-score group trained
    # The first call starts the sampler's first 4 prompts (seed 0): 1044, 1046, 1017 and
    # 1003, of which 1044 and 1017 score equal, so step 1 alone drops two groups.
    assert drawn[0].metrics["rollout/dynamic_sampling_dropped"] >= 2
    stream, engine = _stream(monkeypatch, steps=4, staleness=1, per_call=MAX, delay=0.0,
                             dynamic_rounds=0)
    drawn = _train(stream, engine, 1, 4, train_s=0.0)
    stream.stop()
    shorts = [d.metrics["rollout/dynamic_sampling_short"] for d in drawn]
    constant = [sum(p.ids[0] % 3 == 0 for p in d.prompts[::3]) for d in drawn]
    assert shorts == constant and sum(constant) >= 1
    assert all(d.metrics["rollout/dynamic_sampling_dropped"] == 0 for d in drawn)


def test_groups_dynamic_sampling_drops_for_failed_scores_count_against_the_bound(
        monkeypatch):
    """Every third prompt's samples have no score (a failing scorer): dynamic sampling drops
    those groups as having nothing to compare, and the step trains only scored ones, but the
    bound counts the dropped groups' failures too: the first step stops naming the reason."""
    from megarlhf.ppo.rewards import RewardFnError

    def failing(config, data, workers, answers, samples, step):
        scored = _score(config, data, workers, answers, samples, step)
        bad = [answers.prompts[c.prompt_index].ids[0] % 3 == 0 for c in answers.completions]
        return Scored(torch.where(torch.tensor(bad), math.nan, scored.score), scored.metrics,
                      None, ["reward_url x failed" if b else None for b in bad])

    stream, engine = _stream(monkeypatch, steps=2, staleness=1, per_call=MAX, delay=0.0,
                             dynamic_rounds=2, score=failing)
    with pytest.raises(RewardFnError, match=r"step 1: \d+ of \d+ samples have no score .*"
                                            r"last failure: reward_url x failed"):
        _train(stream, engine, 1, 2, train_s=0.0)
    stream.close()


class TwoTurnEpisodes:
    """Episodes of two model turns of 2 tokens (7, 7) with one observation token (99)
    between; the environment's step lasts until the engine's weights move on (at most
    `think_s`); keys as the real runner deals them (a prompt's n episodes in a row)."""

    def __init__(self, engine, think_s: float):
        self.engine, self.think_s = engine, think_s

    def run(self, prompts, params, generate):
        from megarlhf.envs.episodes import Episode

        keys = list(range(len(prompts) * params.n))
        context = {k: list(prompts[k // params.n].ids) for k in keys}
        done = {k: ([], [], []) for k in keys}  # tokens, logprobs, sampled
        for turn in range(2):
            turn_params = dataclasses.replace(params, n=1, max_new_tokens=2,
                                              max_new_tokens_each=(2,) * len(keys))
            for k, c in zip(keys, generate([context[k] for k in keys], turn_params, keys)):
                assert context[k][1:] == [7, 7, 99][:len(context[k]) - 1]
                for part, values in zip(done[k], (c.token_ids, c.logprobs,
                                                   [True] * len(c.token_ids))):
                    part += values
                context[k] += c.token_ids
            if turn == 0:
                version, deadline = self.engine.version, time.monotonic() + self.think_s
                while self.engine.version == version and time.monotonic() < deadline:
                    time.sleep(0.005)
                for k in keys:
                    for part, value in zip(done[k], (99, 0.0, False)):
                        part.append(value)
                    context[k].append(99)
        return [Episode(prompt=prompts[k // params.n], completion=Completion(
            prompt_index=k, token_ids=done[k][0], logprobs=done[k][1], finish_reason="length",
            sampled=tuple(done[k][2])), parts=(), rewards_at=(), conversation=(),
            final_response="", final_ids=()) for k in keys], {"env/turns_mean": 2.0}


class EpisodeEngine(ScriptedEngine):
    def rollout(self, prompts, params, keys):
        assert not self.syncing, "an engine call during a weight sync"
        self.calls += 1
        return [Completion(prompt_index=row, token_ids=[7, 7],
                           logprobs=[-float(self.version)] * 2, finish_reason="length")
                for row in range(len(prompts))]


def _take_syncing_after_a_call(stream, engine, *, steps: int) -> list:
    """Steps 1..steps as the controller runs them, each step's weight sync made once the
    engine has had a call since the last (the next batch of episodes began), so a sync
    falls between an episode's calls; the stream stopped after. Each step's rollout."""
    drawn, served = [], 0
    for step in range(1, steps + 1):
        drawn.append(stream.take(step))
        deadline = time.monotonic() + 10
        while engine.calls == served:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        with stream.paused():
            engine.syncing = True
            engine.version = step
            stream.synced(step)
            engine.syncing = False
        served = engine.calls
    stream.stop()
    return drawn


def test_episodes_take_weight_syncs_between_their_turns(monkeypatch):
    """With an environment, a batch of episodes runs to its end, and a weight sync waits
    only for the turn in progress: episodes begun under one version finish their second turn
    under the next, each model token keeping its turn's version (the observation token, not
    trained, that of the turn before), and the lags count the model's tokens only."""
    stream, _ = _stream(monkeypatch, steps=4, staleness=1, per_call=1, delay=0.0)
    engine = EpisodeEngine(0.0)
    stream.workers, stream.data.episodes = engine, TwoTurnEpisodes(engine, think_s=0.5)
    drawn = _take_syncing_after_a_call(stream, engine, steps=4)
    assert stream._error is None
    for step, d in enumerate(drawn, start=1):
        assert len(d.episodes) == 6 and d.episodes[0].completion.sampled == (True,) * 2 + (
            False,) + (True,) * 2
        for c, versions in zip(d.completions, d.versions):
            assert versions[2] == versions[1]  # the observation: its turn's version
            assert c.logprobs == [-float(v) if sampled else 0.0
                                  for v, sampled in zip(versions, c.sampled)]
        lags = [step - 1 - v for versions in d.versions for i, v in enumerate(versions)
                if i != 2]
        assert d.metrics["rollout/policy_lag_mean"] == pytest.approx(sum(lags) / len(lags))
        assert max(lags) <= 1
    # Step 2 takes the first batch's second half, and sync 2 follows once the second batch
    # (begun after sync 1) has had its first turn; its environment step waits for the sync,
    # so step 3 trains episodes whose first turn is of version 1 and second of version 2.
    assert all(v == [1, 1, 1, 2, 2] for v in drawn[2].versions), drawn[2].versions


def test_an_agents_tokens_keep_the_versions_of_their_engine_calls(monkeypatch, tmp_path):
    """fully_async with an agent program (tests/agent_programs.two_completions: two
    /v1/completions calls over the run's endpoint, a pause between): a weight sync may come
    between an episode's calls, and each token keeps the version of the engine call that
    sampled it (the text the program added between: the call before), through
    Episode.engine_calls; the lags count the model's tokens only."""
    pytest.importorskip("openai")
    from megarlhf.data.templates import PromptFormat
    from megarlhf.data.tokenizer import load_tokenizer
    from megarlhf.envs.agents import AgentLimits, AgentRunner, load_agent
    from tests import chat_tokenizer

    tok = load_tokenizer(chat_tokenizer.save(str(tmp_path)))
    stream, _ = _stream(monkeypatch, steps=3, staleness=1, per_call=1, delay=0.0)
    engine = EpisodeEngine(0.0)
    stream.workers = engine
    stream.data.episodes = AgentRunner(
        load_agent("tests.agent_programs:two_completions"), PromptFormat(tok, "plain"),
        AgentLimits(max_calls=4, max_new_tokens=40, max_tokens=200, timeout=30.0,
                    max_requests=64), name="two_completions", tool_parser="hermes",
        scored_elsewhere=True)
    drawn = _take_syncing_after_a_call(stream, engine, steps=3)
    assert stream._error is None
    spanning = 0
    for step, d in enumerate(drawn, start=1):
        assert len(d.episodes) == 6
        for c, versions in zip(d.completions, d.versions):
            between = len(c.token_ids) - 4  # " go on" as tokens, between two completions
            assert list(c.sampled) == [True] * 2 + [False] * between + [True] * 2
            assert c.logprobs == [-float(v) if sampled else 0.0
                                  for v, sampled in zip(versions, c.sampled)]
            assert versions[2:2 + between] == [versions[1]] * between
            spanning += versions[0] != versions[-1]
        lags = [step - 1 - v for versions, c in zip(d.versions, d.completions)
                for v, sampled in zip(versions, c.sampled) if sampled]
        assert d.metrics["rollout/policy_lag_mean"] == pytest.approx(sum(lags) / len(lags))
    assert spanning > 0  # some episode's calls straddled a sync


def test_an_engine_failure_reaches_the_waiting_step(monkeypatch):
    """The producer's exception is raised by the step that waits for its groups, once."""
    stream, engine = _stream(monkeypatch, steps=2, staleness=1, per_call=2, delay=0.0)

    def broken(*args, **kwargs):
        raise ConnectionError("rollout rank 0 is gone")

    engine.rollout = broken
    with pytest.raises(ConnectionError, match="rollout rank 0 is gone"):
        stream.take(1)
    assert not stream.drawing()
    stream.close()
    assert not any(t.name in ("rollout-stream", "rollout-scorer")
                   for t in threading.enumerate())


def test_groups_are_scored_while_the_engines_generate_the_others(monkeypatch):
    """The first scoring waits until the engine has made another call: were scoring in the
    producer's thread, between its calls, none would come (it gives up after 10 s and the
    test fails). The steps' groups are as without it. A scoring failure reaches the waiting
    step."""
    overlaps = []

    def slow_score(config, data, workers, answers, samples, step):
        calls, start = engine.calls, time.monotonic()
        limit = 0.1 if overlaps else 10.0  # the first waits for a call; later ones watch
        while engine.calls == calls and time.monotonic() < start + limit:
            time.sleep(0.001)
        overlaps.append(engine.calls > calls)
        return _score(config, data, workers, answers, samples, step)

    stream, engine = _stream(monkeypatch, steps=3, staleness=1, per_call=1, delay=0.002,
                             score=slow_score)
    drawn = _train(stream, engine, 1, 3, train_s=0.0)
    stream.stop()
    assert stream._error is None and overlaps[0], overlaps
    for step, d in enumerate(drawn, start=1):
        _check(step, d, staleness=1)

    def failing(*args):
        raise RuntimeError("the judge group is gone")

    stream, engine = _stream(monkeypatch, steps=2, staleness=1, per_call=2, delay=0.0,
                             score=failing)
    with pytest.raises(RuntimeError, match="the judge group is gone"):
        stream.take(1)
    with pytest.raises(RuntimeError, match="the judge group is gone"):
        stream.snapshot()  # what the failed scorer left will never be scored: no waiting
    stream.close()
