"""Time to recover from a rollout engine's death in a disaggregated run, on the real-model
GRPO recipe (recipes/smollm2-135m-grpo-arithmetic.yaml: SmolLM2-135M-Instruct, Megatron
rollouts) at placement=disaggregated, nproc=1 (an actor, a ref and a rollout rank).

The rollout rank is killed (SIGKILL) once step 3 is logged, as `megarlhf ppo` runs in its own
process: step 4's generate finds it dead, the rollout group alone is started again, the
channel reopened and the weights synced whole, and the call made again (the trainer's groups
keep their state: no checkpoint is loaded, no step is lost). Measured: the engine_restart
event's `seconds` (the new rollout group started, connected and synced), the seconds from
the kill to step 4 being logged, step 4's wall time, and the run's median step time for
scale. The run must finish (exit code 0) with one engine_restart event and no whole restart.

    python -m bench.bench_engine_restart [--append BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import time

import psutil

from bench.bench_faults import logged_so_far, start_run
from bench.bench_rlvr import recipe_inputs
from bench.report import append_entry
from megarlhf.metrics import read_metrics
from tests.ranks import rank_processes

KILLED_AFTER = 3
"""The rollout rank is killed once this step is logged (its next call is the next step's
generate: no checkpoint is saved after it)."""


def recover(tmp: str, inputs: list[str]) -> dict:
    """One run with the rollout rank killed after step KILLED_AFTER: the restart's seconds,
    the seconds from the kill to the next step's log, that step's and the median step's
    wall time."""
    out_dir = os.path.join(tmp, "run")
    overrides = [*inputs, f"out_dir={out_dir}", "steps=5", "save_every=2", "val_every=0",
                 "placement=disaggregated", "nproc=1", "max_restarts=0"]
    proc = start_run(out_dir, overrides)
    killed = logged = None
    while proc.poll() is None:
        records = logged_so_far(out_dir)
        last = max((r["step"] for r in records if "step" in r), default=0)
        if killed is None and last >= KILLED_AFTER:
            # Local ranks start group by group: the rollout group is the last.
            rank_processes(psutil.Process(proc.pid), "local")[-1].send_signal(signal.SIGKILL)
            killed = time.time()
        if killed is not None and logged is None and last > KILLED_AFTER:
            logged = time.time()
        time.sleep(0.05)
    records = read_metrics(out_dir)
    events = [r for r in records if r.get("event") in ("restart", "engine_restart")]
    if proc.returncode != 0 or [e["event"] for e in events] != ["engine_restart"]:
        raise RuntimeError(f"the run did not recover by an engine restart ({events}):\n"
                           + open(out_dir + ".err").read()[-3000:])
    walls = {r["step"]: r["time/wall"] for r in records if "time/wall" in r}
    return {"cause": events[0]["cause"], "restart_s": events[0]["seconds"],
            "kill_to_step_s": round(logged - killed, 2),
            "step_s": round(walls[KILLED_AFTER + 1], 2),
            "median_step_s": round(statistics.median(
                w for step, w in walls.items() if step not in (1, KILLED_AFTER + 1)), 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--append", default=None, help="append the results to this file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        _, _, inputs = recipe_inputs(tmp)
        r = recover(tmp, inputs)
    body = (f"| cause | engine restart (s) | kill to step {KILLED_AFTER + 1} logged (s) | "
            f"step {KILLED_AFTER + 1} (s) | median step (s) |\n|---|---|---|---|---|\n"
            f"| {r['cause']} | {r['restart_s']} | {r['kill_to_step_s']} | {r['step_s']} | "
            f"{r['median_step_s']} |\n\nThe recipe at placement=disaggregated, nproc=1 (actor, "
            f"ref and rollout ranks), steps=5, save_every=2, val_every=0, max_restarts=0; the "
            f"rollout rank SIGKILLed once step {KILLED_AFTER} was logged. 'engine restart': the "
            f"engine_restart event's seconds (the rollout group started again, the channel "
            f"reopened, the weights synced whole); the step then drew its samples again. No "
            f"checkpoint was loaded and no step was lost (a whole restart: python -m "
            f"bench.bench_faults).")
    print(body)
    print(json.dumps(r))
    if args.append:
        append_entry(args.append, "Time to recover from a rollout engine's death (SmolLM2-135M "
                     "GRPO recipe, disaggregated, local ranks)",
                     "python -m bench.bench_engine_restart", body)


if __name__ == "__main__":
    main()
