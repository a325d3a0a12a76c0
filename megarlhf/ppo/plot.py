"""`megarlhf plot RUN_DIR`: a run's metrics.jsonl as PNG curves, one panel per metric."""

from __future__ import annotations

import math
import os

from megarlhf.metrics import read_metrics

DEFAULT_KEYS = ("reward/mean", "kl", "entropy", "actor/policy_loss", "critic/value_loss",
                "actor/clip_fraction", "response_length", "rollout/logprob_gap_max")


def plot_run(run_dir: str, out: str | None = None, keys: tuple[str, ...] = DEFAULT_KEYS) -> str:
    import matplotlib

    matplotlib.use("Agg")  # files only; no display on clusters
    import matplotlib.pyplot as plt

    if not os.path.isfile(os.path.join(run_dir, "metrics.jsonl")):
        raise ValueError(f"{run_dir} has no metrics.jsonl (is it a run's out_dir?)")
    rows = read_metrics(run_dir)
    present = [k for k in keys if any(k in r for r in rows)]
    if not present:
        raise ValueError(f"none of {list(keys)} was logged in {run_dir}")
    cols = min(4, len(present))
    fig, axes = plt.subplots(math.ceil(len(present) / cols), cols, squeeze=False,
                             figsize=(4 * cols, 3 * math.ceil(len(present) / cols)))
    for ax, key in zip(axes.flat, present):
        points = [(r["step"], r[key]) for r in rows if key in r]
        ax.plot([p[0] for p in points], [p[1] for p in points], marker=".")
        ax.set_title(key)
        ax.set_xlabel("step")
    for ax in list(axes.flat)[len(present):]:
        ax.axis("off")
    fig.tight_layout()
    out = out or os.path.join(run_dir, "curves.png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
