"""A `verifiers` environment as an agent program: `verifiers_agent(load_environment)` is the
`agent:` function that runs one rollout of the environment per episode against the run's
OpenAI-compatible endpoint and returns the environment's reward.

verifiers' classic `Environment` (`SingleTurnEnv`, `ToolEnv`, `MultiTurnEnv`, ...; tested
with verifiers 0.3.1) runs a rollout with an OpenAI client, asks the model through it, and
scores the conversation with its rubric. The run's rows are the rollout inputs: `prompt` (a
string or chat messages, system prompt included as verifiers' formatted datasets hold it),
`answer` (or the row's `ground_truth`), `info` and `task` when present.

verifiers turns failures into numbers: a reward function that raises or returns no number
scores 0.0, a failed model call or an environment timeout ends the rollout and it is scored
anyway. Here each fails the episode, so it is masked and counted (`agent/errors`) instead of
trained as a score. (A rubric that catches its own errors, as verifiers' MathRubric does,
is out of reach.) An empty answer is an answer, though: the endpoint gives one when the
episode's budget is spent, and verifiers would fail the rollout on it."""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import inspect
import math
import numbers
import signal
import sys
from typing import Any, Callable

_FAILURES: contextvars.ContextVar[list | None] = contextvars.ContextVar(
    "megarlhf_verifiers_failures", default=None)
"""The running rollout's reward-function failures (verifiers logs them and scores 0.0)."""
FAILED_STOPS = ("timeout_reached", "prompt_too_long")
"""verifiers' stop conditions of a rollout cut short by the environment, then scored."""


def verifiers_agent(load_environment: Callable[[], Any]):
    """The agent program for the environment `load_environment()` returns. The environment
    is built here, where the run loads its agent (before launch, in the launching process
    too), so a missing package or an environment megarlhf cannot train stops the run there
    in one line."""
    import verifiers as vf
    from openai import AsyncOpenAI

    if not hasattr(vf, "OpenAIChatCompletionsClient"):
        raise ValueError(f"verifiers {vf.__version__} has no classic Environment API with "
                         f"OpenAI clients; install verifiers==0.3.1")
    with _keeping_signal_handlers(vf.Environment):
        env = load_environment()
    _check(env, vf)
    _reporting_failures(env.rubric)
    client_class = _answers_may_be_empty(vf)

    async def agent(*, base_url: str, api_key: str, model: str, row: dict) -> float:
        client = client_class(AsyncOpenAI(base_url=base_url, api_key=api_key))
        failures: list = []
        _FAILURES.set(failures)
        # The environment's own sampling arguments (its max_tokens, say), as its generate()
        # passes them; the run's sampling settings apply over them at the endpoint.
        output = await env.run_rollout(rollout_input(row), client, model,
                                       copy.deepcopy(env.sampling_args))
        if output.get("error"):
            raise RuntimeError(f"the verifiers rollout failed: {output['error']['message']}")
        if output.get("stop_condition") in FAILED_STOPS:
            raise RuntimeError(f"the verifiers rollout stopped: {output['stop_condition']}")
        if failures:
            raise RuntimeError(f"a verifiers reward function failed: {failures[0]}")
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


def _check(env, vf) -> None:
    """What verifiers would score without computing: refused."""
    name = type(env).__name__
    if isinstance(env, vf.EnvGroup):
        raise ValueError(f"{name}: an EnvGroup scores with its members' rubrics; train one "
                         f"environment per run")
    if not env.score_rollouts:
        raise ValueError(f"{name} has score_rollouts=False (verifiers scores every rollout "
                         f"0.0); build it with score_rollouts=True")
    if env.rubric.has_group_rewards:
        raise ValueError(f"{name}'s rubric has group reward functions, which verifiers "
                         f"scores only over a group; use per-rollout reward functions")


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


def _answers_may_be_empty(vf):
    """verifiers' OpenAI chat client, taking an empty answer that has a finish reason as an
    answer: the endpoint's answer to a call past the episode's budget (finish_reason
    "length"), or a model ending its turn at once. verifiers fails the rollout on it, which
    would mask exactly the episodes a length limit should teach."""
    class Client(vf.OpenAIChatCompletionsClient):
        async def raise_from_native_response(self, response) -> None:
            try:
                await super().raise_from_native_response(response)
            except vf.EmptyModelResponseError:
                if not (response is not None and response.choices
                        and len(response.choices) == 1 and response.choices[0].finish_reason):
                    raise

    return Client


def _reporting_failures(rubric) -> None:
    """Each reward function of `rubric` (and of a rubric group's members) records, for the
    episode, an exception or a value that is not a finite number, before verifiers turns it
    into 0.0."""
    pending = [rubric]
    while pending:
        rubric = pending.pop()
        rubric.funcs = [_reporting(f) for f in rubric.funcs]
        pending += getattr(rubric, "rubrics", [])


def _reporting(func):
    def record(failure: str) -> None:
        failures = _FAILURES.get()
        if failures is not None:
            failures.append(f"{getattr(func, '__name__', func)!s}: {failure}")

    # functools.wraps keeps the name (verifiers' metric key) and, through __wrapped__, the
    # signature verifiers reads to choose the arguments it passes. Always async: verifiers
    # awaits what a reward function returns when it is awaitable.
    @functools.wraps(func)
    async def reported(*args, **kwargs):
        try:
            value = func(*args, **kwargs)
            if inspect.isawaitable(value):
                value = await value
        except Exception as e:
            record(f"{type(e).__name__}: {e}")
            raise
        if not isinstance(value, numbers.Real) or not math.isfinite(value):
            record(f"returned {value!r}, not a number")
        return value

    return reported
