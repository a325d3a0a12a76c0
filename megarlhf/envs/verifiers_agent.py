"""A `verifiers` environment as an agent program: `verifiers_agent(load_environment)` is the
`agent:` function that runs one rollout of the environment per episode against the run's
OpenAI-compatible endpoint and returns the environment's reward.

verifiers' classic `Environment` (verifiers 0.1-0.3: `SingleTurnEnv`, `ToolEnv`,
`MultiTurnEnv`, ...) runs a rollout with an OpenAI client, asks the model through it, and
scores the conversation with its rubric. The run's rows are the rollout inputs: `prompt` (a
string or chat messages, system prompt included as verifiers' formatted datasets hold it),
`answer` (or the row's `ground_truth`), `info` and `task` when present. verifiers turns
failures into numbers (a reward function that raises scores 0.0, a failed model call ends
the rollout with `error` set and is scored anyway); here either fails the episode, so it is
masked and counted (`agent/errors`) instead of trained as a 0."""

from __future__ import annotations

import contextlib
import copy
import contextvars
import functools
import inspect
import signal
import sys
from typing import Any, Callable

_FAILURES: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "megarlhf_verifiers_failures", default=None)
"""The running rollout's reward-function exceptions (verifiers logs them and scores 0.0)."""


def verifiers_agent(load_environment: Callable[[], Any]):
    """The agent program for the environment `load_environment()` returns (called once, on
    the first episode, in the run's agent thread). verifiers and openai are imported here,
    so a run without them stops before launch, where its agent is loaded."""
    import verifiers as vf
    from openai import AsyncOpenAI

    built: list = []

    async def agent(*, base_url: str, api_key: str, model: str, row: dict) -> float:
        if not built:  # no await between the check and the append: built once
            with _keeping_signal_handlers(vf.Environment):
                built.append(_reporting_failures(load_environment()))
        client = vf.OpenAIChatCompletionsClient(
            AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0))
        failures: list = []
        _FAILURES.set(failures)
        env = built[0]
        # The environment's own sampling arguments (its max_tokens, say), as its generate()
        # passes them; the run's sampling settings apply over them at the endpoint.
        output = await env.run_rollout(rollout_input(row), client, model,
                                       copy.deepcopy(env.sampling_args))
        if output.get("error"):
            raise RuntimeError(f"the verifiers rollout failed: {output['error']}")
        if failures:
            raise RuntimeError(f"a verifiers reward function raised: {failures[0]!r}")
        return float(output["reward"])

    return agent


def rollout_input(row: dict) -> dict:
    """verifiers' RolloutInput of a row: its prompt as chat messages, answer, info, task."""
    prompt = row["prompt"]
    out = {"prompt": [{"role": "user", "content": prompt}] if isinstance(prompt, str)
           else list(prompt),
           "example_id": row.get("example_id", 0)}
    answer = row.get("answer", row.get("ground_truth"))
    if answer is not None:
        out["answer"] = str(answer)
    for key in ("info", "task"):
        if key in row:
            out[key] = row[key]
    return out


class _NoHandlers:
    """The `signal` module as verifiers' Environment module sees it while an environment is
    built, without `signal.signal`: verifiers installs SIGINT/SIGTERM handlers (its teardown,
    then exit) in every environment it builds, which would replace the run's own (checkpoint
    and stop on a preemption's SIGTERM), and raises outside the main thread."""

    def __getattr__(self, name):
        return getattr(signal, name)

    @staticmethod
    def signal(*_):
        return None


@contextlib.contextmanager
def _keeping_signal_handlers(environment_class):
    module = sys.modules[environment_class.__module__]
    if getattr(module, "signal", None) is not signal:
        yield
        return
    module.signal = _NoHandlers()
    try:
        yield
    finally:
        module.signal = signal


def _reporting_failures(env):
    """`env` with each reward function of its rubric (and of a rubric group's members)
    recording its exception for the episode before verifiers turns it into 0.0."""
    pending = [env.rubric]
    while pending:
        rubric = pending.pop()
        rubric.funcs = [_reporting(f) for f in rubric.funcs]
        pending += getattr(rubric, "rubrics", [])
    return env


def _reporting(func):
    def record(e: Exception) -> None:
        failures = _FAILURES.get()
        if failures is not None:
            failures.append(e)

    # functools.wraps keeps the name (verifiers' metric key) and, through __wrapped__, the
    # signature verifiers reads to choose the arguments it passes.
    if inspect.iscoroutinefunction(func):
        @functools.wraps(func)
        async def reported(*args, **kwargs):
            try:
                return await func(*args, **kwargs)
            except Exception as e:
                record(e)
                raise
    else:
        @functools.wraps(func)
        def reported(*args, **kwargs):
            try:
                return func(*args, **kwargs)
            except Exception as e:
                record(e)
                raise
    return reported
