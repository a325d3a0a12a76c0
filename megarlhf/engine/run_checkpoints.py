"""A run's step checkpoints, the same for every stage (SFT, RM, PPO): one directory per saved
step, <out_dir>/checkpoints/step_<N>. This module names them, lists the complete ones, finds
the latest, prunes all but the last `keep_last`, and removes what an interrupted save or prune
left behind. What a step directory holds is the stage's business: one model checkpoint
(SFT / RM: engine/checkpoint.py) or the workers' models and the controller state (PPO:
ppo/checkpoints.py).

A stage names the file its save writes last (`marker`): a step directory is complete once it
holds it. Saves write step_<N>.tmp and rename it when complete; a prune renames a complete
step_<N> to step_<N>.deleting before deleting it, so a kill at any point never leaves a
step_<N> that looks complete, and only complete directories, which our saves wrote, are pruned.

SFT / RM runs of earlier versions named steps zero-padded (step_0000004): the names parse to
the same step numbers, so their checkpoints are still found, resumed from and pruned.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil

log = logging.getLogger(__name__)

ROOT = "checkpoints"
_STEP = re.compile(r"^step_(\d+)$")
# Saves write step_N.tmp; a prune renames to step_N.deleting; engine/checkpoint.replace_dir
# keeps the step it replaces as .step_N.megarlhf-old until the new one is in place.
_LEFTOVER = re.compile(r"^(step_\d+\.(tmp|old|deleting)|\.step_\d+\.megarlhf-old)$")


@dataclasses.dataclass(frozen=True)
class RunCheckpoints:
    out_dir: str
    marker: str
    """The file a stage's save writes last into a step directory."""

    @property
    def root(self) -> str:
        return os.path.join(self.out_dir, ROOT)

    def path(self, step: int) -> str:
        return os.path.join(self.root, f"step_{step}")

    def completed(self) -> list[tuple[int, str]]:
        """(step, path) of every complete step directory, oldest first."""
        if not os.path.isdir(self.root):
            return []
        found = []
        for name in os.listdir(self.root):
            match = _STEP.match(name)
            if match and self._complete(os.path.join(self.root, name)):
                found.append((int(match.group(1)), os.path.join(self.root, name)))
        return sorted(found)

    def latest(self) -> str | None:
        done = self.completed()
        return done[-1][1] if done else None

    def prune(self, keep_last: int) -> None:
        """Delete all complete step directories but the last `keep_last`."""
        for _, old in self.completed()[:-keep_last]:
            os.rename(old, old + ".deleting")
            shutil.rmtree(old + ".deleting")

    def remove_leftovers(self) -> list[str]:
        """Delete what an interrupted save or prune left: step_N.tmp, step_N.old,
        step_N.deleting, .step_N.megarlhf-old, and step_N directories without the marker. Only names our saves make
        are touched; returns them."""
        if not os.path.isdir(self.root):
            return []
        removed = []
        for name in sorted(os.listdir(self.root)):
            path = os.path.join(self.root, name)
            if os.path.isdir(path) and (_LEFTOVER.match(name) or (
                    _STEP.match(name) and not self._complete(path))):
                shutil.rmtree(path)
                removed.append(name)
        if removed:
            log.info("removed what an interrupted run left in %s: %s", self.root,
                     ", ".join(removed))
        return removed

    def _complete(self, path: str) -> bool:
        return os.path.isfile(os.path.join(path, self.marker))
