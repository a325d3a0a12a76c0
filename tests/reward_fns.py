"""Reward functions for tests/test_rewards.py and the text-prompt PPO runs, importable by the
reward worker processes (which import them by module:function)."""

from __future__ import annotations

import os
import signal
import time


def truth_reward(responses, ground_truths, data_sources, **columns):
    """1.0 when the row has a ground truth; reports which columns it was given, so a test can
    see what reached a batched function."""
    return {"scores": [float(t is not None) for t in ground_truths],
            "saw_level": [float(v is not None) for v in columns.get("level", [None] * len(responses))],
            "source_a": [float(s == "a") for s in data_sources]}


def odd_words(responses, **_):
    """1.0 for a response of an odd number of words: a toy policy's samples differ, so the
    validation figures built from them are not constants."""
    return [float(len(r.split()) % 2) for r in responses]


def length_reward(responses, prompts):
    """Characters of the response (named arguments only: no ground truth asked for)."""
    return [float(len(r)) for r in responses]


def first_id_reward(prompt_ids, response_ids):
    return float(response_ids[0])


def verl_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's compute_score convention: a dict with 'score' and a metric."""
    return {"score": 2.0 if solution_str == ground_truth else 0.0,
            "had_extra": float(bool(extra_info))}


def hanging_reward(responses, ground_truths, **_):
    """Hangs on rows whose ground truth is 'hang', else scores 1."""
    if "hang" in ground_truths:
        time.sleep(600)
    return [1.0] * len(responses)


def dying_reward(responses, **_):
    os._exit(3)


def short_reward(responses, **_):
    return [1.0]


def no_responses_asked(x):
    return 0.0


FLAT_MARK = 7
"""A prompt starting with this token id gets the same reward for every answer."""


def flat_or_varied(prompt_ids, response_ids):
    """5.0 for every answer to a marked prompt (a group that teaches nothing); otherwise the
    answer's first token id mod 3, which differs between samples."""
    return 5.0 if prompt_ids[0] == FLAT_MARK else float(response_ids[0] % 3)


def conversation_reward(responses, conversation):
    """For episodes: the final turn's length / 10 plus the tool messages of the episode (the
    `conversation` column an episode gives a reward function)."""
    return [len(r) / 10 + sum(m["role"] == "tool" for m in c)
            for r, c in zip(responses, conversation)]


def killed_once(responses, **_):
    """Killed by SIGKILL (as the out-of-memory killer kills) the first time: the first
    response names a marker file it creates then; scores 1 once the file exists."""
    if not os.path.exists(responses[0]):
        open(responses[0], "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    return [1.0] * len(responses)


def always_killed(responses, **_):
    os.kill(os.getpid(), signal.SIGKILL)


def low_letters(responses, **_):
    """The share of a response's characters among a-h (0 for an empty one)."""
    return [sum(c in "abcdefgh" for c in r) / max(1, len(r)) for r in responses]
