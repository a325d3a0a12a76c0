"""User reward functions: `module:function` taking (prompt_ids, response_ids) -> float."""

from __future__ import annotations

import importlib
from typing import Callable

RewardFn = Callable[[list[int], list[int]], float]


def load_reward_fn(spec: str) -> RewardFn:
    module, sep, name = spec.partition(":")
    if not sep:
        raise ValueError(f"reward_fn {spec!r} must be 'module:function'")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"cannot load reward_fn {spec!r}: {e}") from None
    if not callable(fn):
        raise ValueError(f"reward_fn {spec!r} is not callable")
    return fn
