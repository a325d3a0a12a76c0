"""Rule-checked rewards: the built-in checkers, how a user's reward function is called
(calls.py), and the worker processes that call it with a timeout (pool.py). The PPO loop reaches
all of it through one wrapper, megarlhf.ppo.rewards.RewardFunction."""

from megarlhf.rewards.builtin import (
    BUILTINS, exact_match_reward, format_reward, math_reward,
)

__all__ = ["BUILTINS", "exact_match_reward", "format_reward", "math_reward"]
