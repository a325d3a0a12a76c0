"""Metrics to the console and to a JSONL file (one object per line), from rank 0 only."""

from __future__ import annotations

import json
import os


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3e}" if value and (abs(value) < 1e-3 or abs(value) >= 1e4) \
            else f"{value:.4f}"
    return str(value)


class MetricsLog:
    def __init__(self, path: str | None, prefix: str):
        """`path` None: this rank writes and prints nothing (every rank but 0)."""
        self.path, self.prefix = path, prefix

    def write(self, record: dict, *, echo: bool = True) -> None:
        if self.path is None:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if echo:
            head = f"{self.prefix} {record.get('split', record.get('event', ''))}"
            if "step" in record:
                head += f" step {record['step']}"
            body = " | ".join(f"{k} {_fmt(v)}" for k, v in record.items()
                              if k not in ("step", "split", "event"))
            print(f"{head} | {body}", flush=True)

    def note(self, text: str) -> None:
        if self.path is not None:
            print(f"{self.prefix}: {text}", flush=True)


def metrics_path(output_dir: str) -> str:
    return os.path.join(output_dir, "metrics.jsonl")
