"""Per-step metrics: computed from the step's tensors, printed, and appended to JSONL."""

from __future__ import annotations

import json
import os
import sys



def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def step_metrics(*, step, score, exp, mask, values, returns, train, gap, kl, kl_coef, timer,
                 skipped) -> dict:
    tokens = mask.sum()
    m = {"step": step, "reward/mean": float(score.mean()), "reward/std": float(score.std()),
         "kl": kl, "kl_coef": kl_coef,
         "entropy": float((exp["entropy"] * mask).sum() / tokens),
         "response_length": float(mask.sum(1).mean()), "skipped": float(skipped),
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


class MetricsLog:
    """JSONL at out_dir/metrics.jsonl (appended, so a resumed run continues the file) and a
    one-line summary per step on stdout."""

    def __init__(self, out_dir: str):
        os.makedirs(out_dir, exist_ok=True)
        self._file = open(os.path.join(out_dir, "metrics.jsonl"), "a")

    def write(self, step: int, metrics: dict) -> None:
        self._file.write(json.dumps(metrics) + "\n")
        self._file.flush()
        keys = ("reward/mean", "kl", "actor/policy_loss", "critic/value_loss", "entropy",
                "rollout/logprob_gap_max", "time/step")
        shown = "  ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics)
        print(f"step {step}: {shown}", file=sys.stdout, flush=True)

    def info(self, message: str) -> None:
        print(message, flush=True)

    def close(self) -> None:
        self._file.close()


def read_metrics(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


