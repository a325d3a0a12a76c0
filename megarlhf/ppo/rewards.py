"""User reward functions: `module:function` taking (prompt_ids, response_ids) -> float, always
called through `RewardFunction`, the one fence around user code: an exception or a value that
is not a real number names the function, the step and the sample, in one line."""

from __future__ import annotations

import importlib
import math
import numbers
import traceback
from typing import Callable

import torch

RewardFn = Callable[[list[int], list[int]], float]


class RewardFnError(ValueError):
    """The user's reward function raised or returned something that is not a reward."""


def load_reward_fn(spec: str) -> RewardFn:
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"reward_fn {spec!r} must be 'module:function'")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load reward_fn {spec!r}: {e}") from None
    if not callable(fn):
        raise ValueError(f"reward_fn {spec!r} is not callable")
    return fn


class RewardFunction:
    """`spec`'s function applied to a step's samples. A non-finite reward is returned as it is
    when `allow_non_finite` (the run's nan_policy=skip drops the step), else it is an error."""

    def __init__(self, spec: str, *, allow_non_finite: bool):
        self.spec, self.fn, self.allow_non_finite = spec, load_reward_fn(spec), allow_non_finite

    def score(self, step: int, prompts: list[list[int]], completions) -> torch.Tensor:
        """[B] rewards of `completions` (each has .prompt_index and .token_ids)."""
        return torch.tensor([self._one(step, i, prompts[c.prompt_index], c.token_ids)
                             for i, c in enumerate(completions)], dtype=torch.float32)

    def _one(self, step: int, sample: int, prompt: list[int], response: list[int]) -> float:
        where = f"reward_fn {self.spec} at step {step}, sample {sample}"
        try:
            value = self.fn(prompt, response)
        except Exception as e:
            frame = traceback.extract_tb(e.__traceback__)[-1]
            raise RewardFnError(f"{where} raised {type(e).__name__}: {e} ({frame.filename}:"
                                f"{frame.lineno}; MEGARLHF_DEBUG=1 shows the traceback)") from e
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        if not isinstance(value, numbers.Real):
            raise RewardFnError(f"{where} returned {value!r} ({type(value).__name__}); it must "
                                f"return a real number")
        value = float(value)
        if not math.isfinite(value) and not self.allow_non_finite:
            raise RewardFnError(f"{where} returned {value}; return a finite number, or set "
                                f"nan_policy=skip to skip steps with such rewards")
        return value
