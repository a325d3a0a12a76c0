"""How a reward function is found and called, told from its signature:

- batched, text-level (TRL's convention): a parameter named `responses` (or `completions`).
  Called once per chunk of samples with lists: `prompts`, `responses`, `ground_truths`,
  `data_sources`, `prompt_ids`, `response_ids`, and every other dataset column by its name, of
  which it gets the ones it names (all with **kwargs). Returns a score per sample, or a dict
  {"scores": [...], "<metric>": [...]} whose other lists are logged as reward/<metric>.
- per sample, verl's `compute_score(data_source, solution_str, ground_truth, extra_info)`: a
  parameter named `solution_str`. Returns a number, or a dict with "score" and metrics.
- per sample on token ids: any other function of two positional parameters
  `(prompt_ids, response_ids)`. Returns a number.

No torch here: the reward worker processes import only this and the user's module.
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, Callable

from megarlhf import named
from megarlhf.rewards.builtin import BUILTINS

BATCH, SAMPLE, IDS = "batch", "sample", "ids"
RESPONSE_NAMES = ("responses", "completions")


@dataclasses.dataclass(frozen=True)
class Sample:
    prompt: str | None
    """The prompt as the model saw it (template applied), decoded; None without a tokenizer."""
    response: str | None
    """The response decoded, special tokens (the stop token) dropped; None without one."""
    prompt_ids: list[int]
    response_ids: list[int]
    ground_truth: Any = None
    data_source: str | None = None
    metadata: dict = dataclasses.field(default_factory=dict)


def load(spec: str, field: str = "reward_fn") -> Callable:
    """The function `spec` names: a built-in's bare name, or 'module:function'."""
    fn = named.load(spec, field, BUILTINS)
    if not callable(fn):
        raise ValueError(f"{field} {spec!r} is not callable")
    return fn


def style_of(spec: str, fn: Callable) -> str:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: the oldest convention
        return IDS
    if any(name in params for name in RESPONSE_NAMES):
        return BATCH
    if "solution_str" in params:
        return SAMPLE
    positional = [p for p in params.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) >= 2 or any(p.kind == p.VAR_POSITIONAL for p in params.values()):
        return IDS
    raise ValueError(f"reward_fn {spec!r}: cannot tell how to call {fn.__name__}"
                     f"{inspect.signature(fn)}; give it a `responses` parameter (batched text), "
                     f"`solution_str` (verl's compute_score) or two positional parameters "
                     f"(prompt_ids, response_ids)")


def needs_text(style: str) -> bool:
    return style != IDS


def batch_kwargs(fn: Callable, samples: list[Sample]) -> dict:
    """The keyword arguments of a batched call on `samples`: what `fn` names, or everything
    when it takes **kwargs."""
    params = inspect.signature(fn).parameters
    offered = batch_fields(samples, next(n for n in RESPONSE_NAMES if n in params))
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return offered
    return {k: v for k, v in offered.items() if k in params}


def batch_fields(samples: list[Sample], response_name: str = "responses") -> dict:
    """Every field of `samples` as lists, one entry per sample: each dataset column by its
    name, then prompts, responses (as `response_name`), ground_truths, data_sources,
    prompt_ids and response_ids (a column named like one of these is left out)."""
    columns = sorted({k for s in samples for k in s.metadata})
    return {**{name: [s.metadata.get(name) for s in samples] for name in columns},
            "prompts": [s.prompt for s in samples],
            response_name: [s.response for s in samples],
            "ground_truths": [s.ground_truth for s in samples],
            "data_sources": [s.data_source for s in samples],
            "prompt_ids": [s.prompt_ids for s in samples],
            "response_ids": [s.response_ids for s in samples]}


def sample_args(style: str, sample: Sample) -> tuple[tuple, dict]:
    if style == SAMPLE:
        return (), {"data_source": sample.data_source, "solution_str": sample.response,
                    "ground_truth": sample.ground_truth, "extra_info": sample.metadata}
    return (sample.prompt_ids, sample.response_ids), {}
