"""Multi-turn episodes: environments that answer the model, tools it can call, and the loop
that turns an episode into a training row with only the model's tokens trained on."""

from megarlhf.envs.base import Environment, Turn

__all__ = ["Environment", "Turn"]
