"""PPO run checkpoints: out_dir/checkpoints/step_<N>/ with the workers' models, optimizers,
schedulers and RNG states, and the controller's state (step, data position, KL controller).

Every rank of every worker group writes its part (ppo/worker.py: save). A step directory is
written as step_<N>.tmp and renamed only when complete, so a crash during a save leaves the
previous checkpoint the latest; only the last `keep_last` are kept, each pruned by renaming
it step_<N>.deleting first, so a kill during the deletion never leaves a step_<N> that looks
complete (run_dir.remove_leftovers deletes such leftovers at the next start).
"""

from __future__ import annotations

import json
import os
import re
import shutil

STATE = "controller.json"
_STEP = re.compile(r"^step_(\d+)$")
_LEFTOVER = re.compile(r"^step_\d+\.(tmp|old|deleting)$")


def root(out_dir: str) -> str:
    return os.path.join(out_dir, "checkpoints")


def completed(out_dir: str) -> list[tuple[int, str]]:
    base = root(out_dir)
    if not os.path.isdir(base):
        return []
    found = []
    for name in os.listdir(base):
        match = _STEP.match(name)
        if match and os.path.isfile(os.path.join(base, name, STATE)):
            found.append((int(match.group(1)), os.path.join(base, name)))
    return sorted(found)


def latest(out_dir: str) -> str | None:
    done = completed(out_dir)
    return done[-1][1] if done else None


def read_state(path: str) -> dict:
    with open(os.path.join(path, STATE)) as f:
        return json.load(f)


def save(config, workers, step: int, state: dict) -> str:
    final = os.path.join(root(config.out_dir), f"step_{step}")
    tmp = final + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    workers.save(tmp)
    with open(os.path.join(tmp, STATE), "w") as f:
        json.dump(state, f)
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)
    for _, old in completed(config.out_dir)[:-config.keep_last]:
        os.rename(old, old + ".deleting")
        shutil.rmtree(old + ".deleting")
    return final


def is_leftover(name: str, path: str) -> bool:
    """A directory an interrupted save or prune left behind in the checkpoints root."""
    return bool(_LEFTOVER.match(name)) or bool(
        _STEP.match(name) and not os.path.isfile(os.path.join(path, STATE)))
