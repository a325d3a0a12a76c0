"""What a user writes to train on multi-turn episodes: an `Environment` answers the model's
turns, a `Turn` is one answer.

    from megarlhf.envs import Environment, Turn

    class RetryArithmetic(Environment):
        def __init__(self, max_tries: int = 3):        # env_args from the recipe
            self.max_tries = max_tries

        def reset(self, row: dict) -> list[dict] | None:
            self.answer, self.tries = row["ground_truth"], 0
            return None                                 # or messages before the first turn

        def step(self, response: str) -> Turn:         # the model's last turn, as text
            self.tries += 1
            right = response.strip() == str(self.answer)
            return Turn(messages=[] if right else [{"role": "user", "content": "Try again."}],
                        reward=float(right), done=right or self.tries == self.max_tries)

One instance per episode (per sample). `step` (and `reset`, `close`) may be `async def`: the
episodes of a step then wait on I/O together on the event loop. A plain `def` runs in one of
`env_workers` threads, so episodes blocked on I/O overlap too: an instance is used by one
thread at a time, but state shared between instances needs a lock. The model's tokens are never
re-tokenized: see megarlhf/envs/episodes.py for how an episode becomes a training row.
"""

from __future__ import annotations

import dataclasses
from typing import Any

ROLES = ("user", "tool", "system")
"""Roles an environment's messages may have (the model's turns are 'assistant')."""


@dataclasses.dataclass(frozen=True)
class Turn:
    messages: list[dict] = dataclasses.field(default_factory=list)
    """The environment's answer to the model's turn: messages {"role": "user" | "tool" |
    "system", "content": text, ...} (a tool message may carry "name" and "tool_call_id"),
    shown to the model before its next turn. Ignored when the episode ends."""
    reward: float = 0.0
    """This turn's reward; the episode's reward is the sum over its turns."""
    done: bool = False
    """The episode ends after this turn."""
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    """Numbers logged as env/<key>, the mean over the step's turns that report the key."""


class Environment:
    """The interface an environment implements (subclassing it is optional: a class with
    these methods will do). Constructed with the recipe's `env_args` as keyword
    arguments."""

    def reset(self, row: dict[str, Any]) -> list[dict] | None:
        """Start an episode on a prompt row: {"prompt": text or [{role, content}, ...],
        "ground_truth", "data_source", and the row's other columns} ("prompt_ids" instead of
        "prompt" for a pre-tokenized row). Returns messages to add after the row's prompt
        before the model's first turn, or None."""
        return None

    def step(self, response: str) -> Turn:
        """The environment's answer to the model's turn `response` (its text, the
        end-of-turn token left out)."""
        raise NotImplementedError

    def close(self) -> None:
        """Called once the episode has ended (or failed)."""
