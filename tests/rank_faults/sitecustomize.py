"""Faults made inside a PPO run's ranks, as GPU clusters see them, for tests/test_ppo.py and
tests/test_ppo_failures.py (`rank_faults` there puts this directory on PYTHONPATH for one
run: the launcher then starts a new server for that run's ranks, which imports
`sitecustomize` at start-up, as tests/broken_sync does).

MEGARLHF_TEST_RANK_FAULTS: one fault per start of the ranks, comma-separated, each
`<rank>:<action>`, made in that rank's third `train` call of its start (the first start's
step 3; after a restart from the step-k checkpoint, step k + 3):

- "hang": the rank sleeps there, alive, never answering (a stuck device, a deadlock);
- "abort": the rank aborts (SIGABRT), as native code failing on its own would;
- "peer_gone": the rank raises what NCCL raises when a peer's process is gone.

A fault that was made leaves a marker in MEGARLHF_TEST_RANK_FAULTS_DIR, so the ranks of the
next start (after a restart) make the next one; every rank reads which at its first call.

And in every rank a collective that times out aborts the rank, as NCCL's watchdog does
(TORCH_NCCL_ASYNC_ERROR_HANDLING=3), where gloo would raise.
"""

import os
import resource
import time

from megarlhf.ppo import groups
from megarlhf.ppo.worker import PPOWorker

_failure = groups._failure
_train = PPOWorker.train
_calls = 0
_fault: int | None = None  # which fault of the list this start makes


def _abort() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file left in the test's cwd
    os.abort()


def _failure_as_nccl():
    failure = _failure()
    if failure[2] == groups.TIMED_OUT:
        _abort()
    return failure


def train(self, *args):
    global _calls, _fault
    # Read per call: this module is imported once by the rank server, whose forks then take
    # their run's environment.
    faults = os.environ["MEGARLHF_TEST_RANK_FAULTS"].split(",")
    markers = os.environ["MEGARLHF_TEST_RANK_FAULTS_DIR"]
    _calls += 1
    if _calls == 1:
        _fault = len(os.listdir(markers))
    if _calls == 3 and _fault < len(faults):
        rank, action = faults[_fault].split(":")
        if self.rank == int(rank):
            open(os.path.join(markers, str(_fault)), "x").close()
            if action == "hang":
                time.sleep(3600)
            elif action == "abort":
                _abort()
            else:
                assert action == "peer_gone", action
                raise RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1970, remote process "
                                   "exited or there was a network error, NCCL version 2.21.5")
    return _train(self, *args)


groups._failure = _failure_as_nccl
PPOWorker.train = train
