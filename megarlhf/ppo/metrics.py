"""A PPO step's metrics, computed from the step's tensors; megarlhf/metrics.py logs them."""

from __future__ import annotations

CONSOLE_KEYS = ("reward/mean", "kl", "actor/policy_loss", "critic/value_loss", "entropy",
                "rollout/logprob_gap_max", "time/step")
"""What a step's console line shows of its many metrics (metrics.jsonl gets all)."""


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def step_metrics(*, step, score, exp, mask, values, advantages, returns, train, gap, kl,
                 kl_coef, timer, skipped, response_tokens) -> dict:
    """`score`: the scored samples' scores; `mask`: the tokens trained (statistics are over
    them: a sample without a score has no part); `response_tokens`: every response token
    the step generated (its throughput)."""
    nan = float("nan")
    tokens = mask.sum()
    trained = advantages[mask.bool()]
    any_trained = bool(tokens > 0)
    m = {"step": step, "reward/mean": float(score.mean()) if len(score) else nan,
         "reward/std": float(score.std()) if len(score) > 1 else nan,
         "kl": kl, "kl_coef": kl_coef,
         "entropy": float((exp["entropy"] * mask).sum() / tokens) if any_trained else nan,
         "response_length": float(tokens / mask.bool().any(1).sum()) if any_trained else nan,
         "skipped": float(skipped),
         # Over the trained tokens: what the algorithm's estimator made of the rewards.
         "advantages/mean": float(trained.mean()) if any_trained else nan,
         "advantages/max": float(trained.max()) if any_trained else nan,
         "advantages/min": float(trained.min()) if any_trained else nan,
         **gap.to_dict()}
    if "teacher_logp" in exp and any_trained:
        # The reverse KL's estimate on the student's own samples: student - teacher logprob.
        teacher = (exp["teacher_logp"] * mask).sum() / tokens
        m["distill/teacher_logprob_mean"] = float(teacher)
        m["distill/reverse_kl"] = float((exp["logp"] * mask).sum() / tokens - teacher)
    if values is not None and any_trained:
        v, r = values[mask.bool()], returns[mask.bool()]
        m["critic/explained_variance"] = float(1 - (r - v).var() / r.var().clamp(min=1e-8))
    for key in sorted({k for t in train for k in t}):
        m[key] = _mean([t[key] for t in train if key in t])
    total = sum(timer.values())
    for phase, seconds in timer.items():
        m[f"time/{phase}"] = seconds
    m["time/step"] = total
    m["tokens_per_s"] = response_tokens / total if total else nan
    return m
