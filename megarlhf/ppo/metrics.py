"""A PPO step's metrics, computed from the step's tensors; megarlhf/metrics.py logs them."""

from __future__ import annotations

CONSOLE_KEYS = ("reward/mean", "kl", "actor/policy_loss", "critic/value_loss", "entropy",
                "rollout/logprob_gap_max", "time/step")
"""What a step's console line shows of its many metrics (metrics.jsonl gets all)."""


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def step_metrics(*, step, score, exp, mask, values, advantages, returns, train, gap, kl,
                 kl_coef, timer, skipped) -> dict:
    tokens = mask.sum()
    trained = advantages[mask.bool()]
    m = {"step": step, "reward/mean": float(score.mean()), "reward/std": float(score.std()),
         "kl": kl, "kl_coef": kl_coef,
         "entropy": float((exp["entropy"] * mask).sum() / tokens),
         "response_length": float(mask.sum(1).mean()), "skipped": float(skipped),
         # Over the trained tokens: what the algorithm's estimator made of the rewards.
         "advantages/mean": float(trained.mean()), "advantages/max": float(trained.max()),
         "advantages/min": float(trained.min()),
         **gap.to_dict()}
    if values is not None:
        v, r = values[mask.bool()], returns[mask.bool()]
        m["critic/explained_variance"] = float(1 - (r - v).var() / r.var().clamp(min=1e-8))
    for key in sorted({k for t in train for k in t}):
        m[key] = _mean([t[key] for t in train if key in t])
    total = sum(timer.values())
    for phase, seconds in timer.items():
        m[f"time/{phase}"] = seconds
    m["time/step"] = total
    m["tokens_per_s"] = float(tokens) / total if total else float("nan")
    return m
