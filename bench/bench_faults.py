"""Time to recover from a fault, per fault kind, on the real-model GRPO recipe
(recipes/smollm2-135m-grpo-arithmetic.yaml: SmolLM2-135M-Instruct, 2 colocated local ranks,
Megatron rollouts), checkpointing every 2 steps.

Each fault is injected from outside into rank 1 once step 3 is logged (the step-2
checkpoint exists), as `megarlhf ppo` runs in its own process:

- kill: SIGKILL (the out-of-memory killer, an operator): the controller sees the rank die.
- hang: SIGSTOP (a rank stuck, alive): its peer's next collective times out after
  `collective_timeout_s` (set to 30 s here; 600 by default).
- kill (Ray): SIGKILL to rank 1's Ray actor, the ranks Ray worker groups on a Ray runtime
  the controller started (it stays up across the restart).

Measured from the injection: when the fault was detected (the restart event's `seconds` is
the time from detection to the new workers' start, after `restart_backoff`, 5 s), when the
restart began, and when the first step after the restart was logged (workers started,
checkpoint loaded, weights synced, the step run again); and the run's median step time for
scale. Every run must finish (exit code 0) with its restart event.

    python -m bench.bench_faults [--append BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import psutil

from bench.bench_rlvr import RECIPE, recipe_inputs
from bench.report import append_entry
from megarlhf.metrics import read_metrics
from tests.ranks import rank_processes

FAULTS = {"kill": (signal.SIGKILL, "local"), "hang": (signal.SIGSTOP, "local"),
          "kill (Ray)": (signal.SIGKILL, "ray")}
"""fault -> (the signal sent to rank 1, worker_group)."""
COLLECTIVE_TIMEOUT_S = 30


def start_run(out_dir: str, overrides: list[str]) -> subprocess.Popen:
    """The recipe run by `megarlhf ppo` in a process of its own (its stderr in
    `<out_dir>.err`), so its ranks can be faulted from here."""
    return subprocess.Popen([sys.executable, "-m", "megarlhf.cli", "ppo", "--config", RECIPE,
                             *overrides], stdout=subprocess.DEVNULL,
                            stderr=open(out_dir + ".err", "w"))


def logged_so_far(out_dir: str) -> list[dict]:
    """The run's metrics.jsonl records written so far."""
    return read_metrics(out_dir) if os.path.isfile(
        os.path.join(out_dir, "metrics.jsonl")) else []


def recover(tmp: str, inputs: list[str], fault: str) -> dict:
    """One run with `fault` injected after step 3: the seconds from the injection to each
    mark, and the median step time."""
    sig, worker_group = FAULTS[fault]
    out_dir = os.path.join(tmp, re.sub(r"\W+", "_", fault).strip("_"))
    overrides = [*inputs, f"out_dir={out_dir}", "steps=5", "save_every=2", "val_every=0",
                 f"collective_timeout_s={COLLECTIVE_TIMEOUT_S}", f"worker_group={worker_group}"]
    proc = start_run(out_dir, overrides)
    seen: dict[str, float] = {}  # mark -> wall time first seen
    injected = None
    while proc.poll() is None:
        records = logged_so_far(out_dir)
        steps = [r["step"] for r in records if "step" in r and "event" not in r]
        restart = [r for r in records if r.get("event") == "restart"]
        now = time.time()
        if injected is None and max(steps, default=0) >= 3:
            rank_processes(psutil.Process(proc.pid), worker_group)[1].send_signal(sig)
            injected = now
        if restart and "restart" not in seen:
            seen["restart"] = now
            seen["detected"] = now - restart[0]["seconds"]
        if "restart" in seen and "step" not in seen:
            after = records[records.index(restart[0]) + 1:]
            if any("step" in r and "event" not in r for r in after):
                seen["step"] = now
        time.sleep(0.1)
    if proc.returncode != 0 or "step" not in seen:
        raise RuntimeError(f"{fault}: the run did not recover:\n"
                           + open(out_dir + ".err").read()[-3000:])
    records = read_metrics(out_dir)
    event = next(r for r in records if r.get("event") == "restart")
    step_s = statistics.median(r["time/step"] for r in records
                               if "time/step" in r and r["step"] > 1)
    return {"fault": fault, "cause": event["cause"], "lost_from": event["failed_step"],
            "resumed": event["resumed_step"],
            **{mark: round(seen[mark] - injected, 1) for mark in ("detected", "restart", "step")},
            "step_s": round(step_s, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--append", default=None, help="append the results to this file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        _, _, inputs = recipe_inputs(tmp)
        rows = [recover(tmp, inputs, fault) for fault in FAULTS]
    lines = ["| fault | cause | fault in step | resumed from step | detected (s) | restart "
             "began (s) | first step after it done (s) | step (s) |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['fault']} | {r['cause']} | {r['lost_from']} | {r['resumed']} | "
                     f"{r['detected']} | {r['restart']} | {r['step']} | {r['step_s']} |")
    body = "\n".join(lines) + (
        f"\n\nSeconds from the injection (into rank 1, once step 3 was logged). The "
        f"recipe at steps=5, save_every=2, val_every=0, collective_timeout_s="
        f"{COLLECTIVE_TIMEOUT_S}, restart_backoff 5 (default); each run resumed from the "
        f"step-2 checkpoint and finished. kill: SIGKILL; hang: SIGSTOP (the peer's "
        f"collective times out). 'first step after it done' includes the back-off, starting "
        f"the ranks, loading the checkpoint and the weights into the rollout engine, and "
        f"running step 3 again. kill (Ray): the same recipe on Ray worker groups (a Ray "
        f"runtime the controller started, kept across the restart), rank 1's actor "
        f"process killed.")
    print(body)
    print(json.dumps(rows))
    if args.append:
        append_entry(args.append, "Time to recover from a fault (SmolLM2-135M GRPO recipe, "
                     "local and Ray ranks)", "python -m bench.bench_faults", body)


if __name__ == "__main__":
    main()
