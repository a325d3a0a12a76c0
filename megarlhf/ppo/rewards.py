"""The one fence around user reward code: `RewardFunction` scores a step's samples with the
run's reward functions (`reward_fn`, and `reward_fn_by_source` for rows of named data sources),
each call in a worker process with a timeout (megarlhf/rewards/pool.py).

What it guarantees the loop: one finite score per sample (a non-finite one only under
nan_policy=skip), in sample order, or the reason it has none; an exception or a value that is
not a score stops the run with one line naming the function, the step and the sample; a call
past `reward_timeout` gives its samples no score (a failure, never a number: the loop masks
them, and max_failed_reward_fraction bounds their share) and is counted (reward/timeouts). A
call whose worker is killed from outside
(the out-of-memory killer) runs again in a fresh worker, counted (reward/worker_restarts);
killed again and again on the same call, it stops the run.
"""

from __future__ import annotations

import collections
import math
import numbers
from typing import Any, NamedTuple

import torch

from megarlhf.rewards import calls
from megarlhf.rewards.calls import Sample
from megarlhf.rewards.pool import CallPool


class RewardFnError(ValueError):
    """The user's reward function raised or returned something that is not a reward, or too
    many of a step's samples could not be scored."""


class Scores(NamedTuple):
    """What a source of scores (reward function, reward service, judge) gives a batch."""

    values: torch.Tensor
    """[B] float32; a failed sample's entry is meaningless (0) and must not be read."""
    metrics: dict[str, float]
    failed: list[str | None]
    """Per sample: why it has no score (the source and its error), or None when it has one."""


class RewardFunction:
    def __init__(self, spec: str | None, by_source: dict[str, str] | None = None, *,
                 allow_non_finite: bool, workers: int = 1, timeout: float = 60.0):
        """`spec` scores every sample whose data source `by_source` does not name (None:
        those samples get no reward function, only the reward model's score)."""
        self.specs = {None: spec, **(by_source or {})}
        self.functions = {s: calls.load(s) for s in set(self.specs.values()) if s}
        self.styles = {s: calls.style_of(s, fn) for s, fn in self.functions.items()}
        self.allow_non_finite = allow_non_finite
        self.pool = CallPool(workers, timeout)
        self._chunks = workers

    @property
    def needs_text(self) -> bool:
        return any(calls.needs_text(style) for style in self.styles.values())

    def close(self) -> None:
        self.pool.close()

    def spec_of(self, sample: Sample) -> str | None:
        return self.specs.get(sample.data_source, self.specs[None])

    def score(self, step: int, samples: list[Sample]) -> Scores:
        """[B] scores of `samples` (0 for samples no function scores), why a sample has none
        (its call timed out), and the step's reward metrics: timed-out samples, and the mean
        of every extra metric a function reports."""
        jobs = []  # (spec, sample indices, args, kwargs): one call each
        by_spec = collections.defaultdict(list)
        for i, sample in enumerate(samples):
            spec = self.spec_of(sample)
            if spec:
                by_spec[spec].append(i)
        for spec, indices in by_spec.items():
            fn, style = self.functions[spec], self.styles[spec]
            if style == calls.BATCH:
                size = math.ceil(len(indices) / self._chunks)
                for start in range(0, len(indices), size):
                    chunk = indices[start:start + size]
                    jobs.append((spec, chunk, (),
                                 calls.batch_kwargs(fn, [samples[i] for i in chunk])))
            else:
                jobs += [(spec, [i], *calls.sample_args(style, samples[i])) for i in indices]
        restarts = self.pool.restarts
        outcomes = self.pool.run([(spec, args, kwargs) for spec, _, args, kwargs in jobs])
        scores, failed = [0.0] * len(samples), [None] * len(samples)
        extras = collections.defaultdict(list)
        timed_out = 0
        for (spec, indices, _, _), outcome in zip(jobs, outcomes):
            where = f"reward_fn {spec} at step {step}, sample {indices[0]}" + \
                (f" (of samples {indices[0]}-{indices[-1]})" if len(indices) > 1 else "")
            if outcome.kind == "timeout":
                timed_out += len(indices)
                for i in indices:
                    failed[i] = f"reward_fn {spec} timed out (reward_timeout=" \
                                f"{self.pool.timeout}s)"
                continue
            if outcome.kind == "error":
                raise RewardFnError(f"{where} {outcome.value}")
            values, metrics = self._read(spec, outcome.value, len(indices), where)
            for i, value in zip(indices, values):
                scores[i] = check_score(value, f"reward_fn {spec} at step {step}, sample {i}",
                                        self.allow_non_finite)
            for name, per_sample in metrics.items():
                extras[name] += [v for v in per_sample if v is not None]
        metrics = {"reward/timeouts": float(timed_out),
                   "reward/worker_restarts": float(self.pool.restarts - restarts)}
        metrics.update({f"reward/{name}": sum(v) / len(v) for name, v in extras.items() if v})
        return Scores(torch.tensor(scores, dtype=torch.float32), metrics, failed)

    def _read(self, spec: str, value: Any, count: int, where: str
              ) -> tuple[list, dict[str, list]]:
        """(scores, {metric: per-sample values}) out of what one call returned."""
        if self.styles[spec] != calls.BATCH:
            if isinstance(value, dict):
                if "score" not in value:
                    raise RewardFnError(f"{where} returned a dict without 'score' "
                                        f"({sorted(value)[:6]})")
                extra = {k: [check_metric(v, k, where)] for k, v in value.items()
                         if k != "score"}
                return [value["score"]], extra
            return [value], {}
        extra = {}
        if isinstance(value, dict):
            if "scores" not in value:
                raise RewardFnError(f"{where} returned a dict without 'scores' "
                                    f"({sorted(value)[:6]}); a batched reward function returns "
                                    f"a score per sample or {{'scores': [...], ...}}")
            extra = {k: v for k, v in value.items() if k != "scores"}
            value = value["scores"]
        if isinstance(value, torch.Tensor):
            value = value.tolist()
        if not isinstance(value, (list, tuple)) or len(value) != count:
            got = f"{len(value)} values" if isinstance(value, (list, tuple)) else \
                f"{type(value).__name__}"
            raise RewardFnError(f"{where} returned {got} for {count} samples; a batched "
                                f"reward function returns one score per sample")
        for name, per_sample in extra.items():
            if not isinstance(per_sample, (list, tuple)) or len(per_sample) != count:
                raise RewardFnError(f"{where} returned metric {name!r} that is not a list of "
                                    f"{count} values")
            extra[name] = [check_metric(v, name, where) for v in per_sample]
        return list(value), extra


def check_metric(value, name: str, where: str) -> float | None:
    """A reported metric's value as a float (None stays None: not counted)."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or isinstance(value, numbers.Real):
        return float(value)
    raise RewardFnError(f"{where} returned metric {name!r} = {value!r}; metrics must be "
                        f"numbers (or None)")


def check_score(value, where: str, allow_non_finite: bool) -> float:
    """A returned score as a float; RewardFnError naming `where` for anything else."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise RewardFnError(f"{where} returned {value!r} ({type(value).__name__}); it must "
                            f"return a real number")
    value = float(value)
    if not math.isfinite(value) and not allow_non_finite:
        raise RewardFnError(f"{where} returned {value}; return a finite number, or set "
                            f"nan_policy=skip to skip steps with such rewards")
    return value
