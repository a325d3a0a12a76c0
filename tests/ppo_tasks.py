"""Reward functions with a known optimum for PPO tests and the demo (importable by workers)."""

from __future__ import annotations

LOW_IDS = 30
"""Token ids below this are 'good': 10% of a 300-token vocabulary, so an untrained policy
scores about 0.1 and the optimum is 1.0."""


def low_token_fraction(prompt_ids: list[int], response_ids: list[int]) -> float:
    return sum(t < LOW_IDS for t in response_ids) / len(response_ids)


def nan_reward(prompt_ids: list[int], response_ids: list[int]) -> float:
    """A broken reward function: every score is NaN (the loop's nan_policy must act)."""
    return float("nan")


# Broken reward functions for the bad-input catalogue (tests/test_bad_inputs.py).

def none_reward(prompt_ids, response_ids):
    return None


def string_reward(prompt_ids, response_ids):
    return "1.0"


def raising_reward(prompt_ids, response_ids):
    return 1 / (len(response_ids) - len(response_ids))


def typed_reward(prompt_ids, response_ids):
    """Rewards of every real type a function may return: int, float, 0-d tensor, inf."""
    import torch

    return [0, 1.0, torch.tensor(2.0), float("inf")][len(response_ids)]
