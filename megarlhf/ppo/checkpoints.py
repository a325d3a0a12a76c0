"""What a PPO step checkpoint holds: every rank's part of the workers' models, optimizers,
schedulers and RNG states (ppo/worker.py: save), the next step's rollout when it was drawn
ahead (one_step_off) or the stream's buffer and samples in flight (fully_async), in
pending_rollout.pt, and the controller's state (step, data position, KL controller, the run's
inputs, the pending rollout's checksum) in controller.json, written last, so a step directory
is complete once it holds it. Naming, finding the latest, pruning to `keep_last` and removing
leftovers: engine/run_checkpoints.py, as for SFT and RM.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import torch

from megarlhf.engine.checkpoint import replace_dir
from megarlhf.engine.run_checkpoints import RunCheckpoints
from megarlhf.integrity import file_sha256

log = logging.getLogger(__name__)

STATE = "controller.json"
PENDING = "pending_rollout.pt"


def of_run(out_dir: str) -> RunCheckpoints:
    return RunCheckpoints(out_dir, marker=STATE)


def read_pending(path: str, state: dict, settings: dict):
    """The rollout a checkpoint kept for its next step, checked against the checksum written
    with it; None if it kept none, or drew it with other `settings` than the run's now (the
    run then draws that step's rollout again, from the prompts after it)."""
    want = state.get("pending_rollout_sha256")
    if want is None:
        return None
    if state.get("pending_rollout_settings") != settings:
        log.warning("%s: its rollout for the next step was drawn with other settings (%s, now "
                    "%s); drawing it again", path, state.get("pending_rollout_settings"),
                    settings)
        return None
    file = os.path.join(path, PENDING)
    if not os.path.isfile(file) or file_sha256(file) != want:
        raise ValueError(f"{file} is missing or does not match the checksum in "
                         f"{os.path.join(path, STATE)}; the checkpoint is damaged: resume "
                         f"from an earlier step_N")
    # Our own file, checksum verified: it holds the rollout's dataclasses, not only tensors.
    return torch.load(file, weights_only=False)


def read_state(path: str) -> dict:
    with open(os.path.join(path, STATE)) as f:
        return json.load(f)


def save(config, workers, step: int, state: dict, pending=None, settings=None) -> str:
    """`pending`: the next step's rollout, drawn ahead (one_step_off), kept with its
    checksum and the `settings` it was drawn with in the controller state."""
    steps = of_run(config.out_dir)
    final = steps.path(step)
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    workers.save(tmp)
    if pending is not None:
        torch.save(pending, os.path.join(tmp, PENDING))
        state = {**state, "pending_rollout_sha256": file_sha256(os.path.join(tmp, PENDING)),
                 "pending_rollout_settings": settings}
    with open(os.path.join(tmp, STATE), "w") as f:
        json.dump(state, f)
    replace_dir(tmp, final)
    steps.prune(config.keep_last)
    return final
