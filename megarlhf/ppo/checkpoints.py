"""What a PPO step checkpoint holds: every rank's part of the workers' models, optimizers,
schedulers and RNG states (ppo/worker.py: save), and the controller's state (step, data
position, KL controller, the run's inputs) in controller.json, written last, so a step
directory is complete once it holds it. Naming, finding the latest, pruning to `keep_last` and
removing leftovers: engine/run_checkpoints.py, as for SFT and RM.
"""

from __future__ import annotations

import json
import os
import shutil

from megarlhf.engine.checkpoint import replace_dir
from megarlhf.engine.run_checkpoints import RunCheckpoints

STATE = "controller.json"


def of_run(out_dir: str) -> RunCheckpoints:
    return RunCheckpoints(out_dir, marker=STATE)


def read_state(path: str) -> dict:
    with open(os.path.join(path, STATE)) as f:
        return json.load(f)


def save(config, workers, step: int, state: dict) -> str:
    steps = of_run(config.out_dir)
    final = steps.path(step)
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    workers.save(tmp)
    with open(os.path.join(tmp, STATE), "w") as f:
        json.dump(state, f)
    replace_dir(tmp, final)
    steps.prune(config.keep_last)
    return final
