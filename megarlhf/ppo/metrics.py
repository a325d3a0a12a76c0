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
    """Each step's metrics to out_dir/metrics.jsonl (appended, so a resumed run continues
    the file), one summary line on stdout, and the optional dashboards: TensorBoard event files
    in out_dir/tensorboard, and a W&B run that a resumed job continues."""

    def __init__(self, out_dir: str, *, tensorboard: bool = False,
                 wandb_project: str | None = None, run_config: dict | None = None):
        os.makedirs(out_dir, exist_ok=True)
        self._file = open(os.path.join(out_dir, "metrics.jsonl"), "a")
        self._tensorboard = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(os.path.join(out_dir, "tensorboard"))
        self._wandb = _wandb_run(out_dir, wandb_project, run_config) if wandb_project else None

    def write(self, step: int, metrics: dict) -> None:
        self._file.write(json.dumps(metrics) + "\n")
        self._file.flush()
        scalars = {k: v for k, v in metrics.items() if k != "step"
                   and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self._tensorboard is not None:
            for key, value in scalars.items():
                self._tensorboard.add_scalar(key, value, step)
            self._tensorboard.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)
        keys = ("reward/mean", "kl", "actor/policy_loss", "critic/value_loss", "entropy",
                "rollout/logprob_gap_max", "time/step")
        shown = "  ".join(f"{k}={metrics[k]:.4g}" for k in keys if k in metrics)
        print(f"step {step}: {shown}", file=sys.stdout, flush=True)

    def info(self, message: str) -> None:
        print(message, flush=True)

    def close(self) -> None:
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()


def _wandb_run(out_dir: str, project: str, run_config: dict | None):
    """A W&B run whose id is kept in out_dir, so a resumed job logs into the same run."""
    import wandb

    id_file = os.path.join(out_dir, "wandb_run_id")
    if os.path.isfile(id_file):
        with open(id_file) as f:
            run_id = f.read().strip()
    else:
        run_id = wandb.util.generate_id()
        with open(id_file + ".tmp", "w") as f:
            f.write(run_id)
        os.replace(id_file + ".tmp", id_file)
    return wandb.init(project=project, id=run_id, resume="allow", dir=out_dir,
                      config=run_config)


class Progress:
    """A progress bar over the run's steps naming the phase in progress, on an interactive
    terminal only (batch logs get the per-step lines instead)."""

    def __init__(self, total: int, done: int):
        self._bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=done, unit="step", dynamic_ncols=True)

    def phase(self, name: str) -> None:
        if self._bar is not None:
            self._bar.set_description(name)

    def step_done(self, metrics: dict) -> None:
        if self._bar is not None:
            self._bar.set_postfix(reward=f"{metrics['reward/mean']:.3g}", refresh=False)
            self._bar.update(1)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


def read_metrics(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


