"""PPO failure handling: a non-finite reward under each nan_policy, and a rank killed mid-run."""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import time

import psutil
import pytest
import torch

from megarlhf.metrics import read_metrics, read_steps
from megarlhf.ppo import checkpoints
from megarlhf.ppo.controller import run
from megarlhf.ppo.groups import WorkerError, WorkerLost
from megarlhf.ppo.rewards import RewardFnError
from tests import role_workers
from tests.ranks import rank_processes
from tests.test_ppo import (  # noqa: F401 (fixtures)
    FAULT_RUN, _final_weights, _ppo_process, _run_killing_the_rollout_rank, _without_timings,
    base, prompts_file, rank_faults,
)

pytestmark = pytest.mark.slow


def test_nan_reward_stops_the_run_with_the_step_and_the_remedy(base, tmp_path):  # noqa: F811
    config = dataclasses.replace(base, reward_fn="tests.ppo_tasks:nan_reward", nproc=1,
                                 tensor_parallel=1, steps=2, out_dir=str(tmp_path))
    with pytest.raises(RewardFnError, match=r"reward_fn tests.ppo_tasks:nan_reward at step 1, "
                                            r"sample 0 returned nan; .*nan_policy=skip"):
        run(config)
    assert checkpoints.of_run(config.out_dir).latest() is None  # nothing half-trained was saved


@pytest.mark.parametrize("one_pass", [False, True], ids=["experience_pass", "update_pass"])
def test_nan_reward_skips_the_update_and_keeps_going(base, tmp_path, one_pass):  # noqa: F811
    """PPO (two epochs: the experience pass gives the old logprobs), and GRPO with one update
    per step, whose update pass would give them: a skipped step has no update pass, so the
    actor's forward runs for the step's logprob gap (still guarded), entropy and KL."""
    config = dataclasses.replace(base, reward_fn="tests.ppo_tasks:nan_reward", nproc=1,
                                 tensor_parallel=1, steps=2, nan_policy="skip",
                                 out_dir=str(tmp_path))
    if one_pass:
        config = dataclasses.replace(config, algorithm="grpo", critic=None, ppo_epochs=1,
                                     mini_batches=1)
    assert config.one_pass_old_logprobs == one_pass
    history = run(config)
    assert [m["skipped"] for m in history] == [1.0, 1.0]
    for m in history:  # fp32 Megatron rollouts: the trainer's logprobs of the same weights
        assert m["rollout/logprob_gap_max"] < 1e-5 and m["entropy"] > 1.0, m
    assert [m["step"] for m in read_steps(config.out_dir)] == [1, 2]
    final = role_workers.checkpoint_tensors(f"{checkpoints.of_run(config.out_dir).latest()}/actor")
    initial = role_workers.checkpoint_tensors(base.actor)
    shared = final.keys() & initial.keys()
    assert shared  # the same model's weights, compared tensor by tensor
    for key in shared:
        assert torch.equal(final[key], initial[key]), f"{key} changed on a skipped step"


def test_a_rank_killed_before_any_checkpoint_ends_the_job_naming_it(base, tmp_path):  # noqa: F811
    """Nothing to restart from yet: one line naming the dead rank and the missing
    checkpoint, exit code 1, no rank left behind."""
    config = dataclasses.replace(base, steps=200, nproc=2, out_dir=str(tmp_path / "run"))
    proc = _ppo_process(config)
    controller = psutil.Process(proc.pid)
    err = config.out_dir + ".yaml.err"
    deadline = time.monotonic() + 300
    while not (os.path.isfile(os.path.join(config.out_dir, "metrics.jsonl"))
               and read_steps(config.out_dir)):
        assert proc.poll() is None and time.monotonic() < deadline, open(err).read()[-3000:]
        time.sleep(0.2)
    ranks = rank_processes(controller, "local")
    assert len(ranks) == config.nproc
    ranks[1].send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    try:
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert time.monotonic() - killed_at < 60
    assert code != 0
    log = open(err).read()
    # Local ranks start in rank order: the killed one is named.
    assert re.search(r"^error: \w+: colocated rank 1 died \(exit code -9\); not restarted: "
                     r"no checkpoint to restart from yet .*; last checkpoint: none$", log,
                     re.M), log[-3000:]
    assert "Traceback" not in log
    survivors = [p for p in ranks if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not survivors, survivors


def test_ctrl_c_stops_every_rank_and_leaves_the_last_checkpoint(base, tmp_path):  # noqa: F811
    """Ctrl-C in a terminal signals the whole foreground process group: the controller stops
    the ranks, prints one line and exits 130; the last checkpoint is complete, so a rerun
    resumes from it."""
    config = dataclasses.replace(base, steps=200, save_every=1, nproc=2, tensor_parallel=2,
                                 out_dir=str(tmp_path / "run"))
    # As from a terminal: a test run started in the background (`make test &`) ignores SIGINT,
    # and its children would inherit that.
    proc = _ppo_process(config, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    controller = psutil.Process(proc.pid)
    err = config.out_dir + ".yaml.err"
    deadline = time.monotonic() + 300
    while checkpoints.of_run(config.out_dir).latest() is None:
        assert proc.poll() is None and time.monotonic() < deadline, open(err).read()[-3000:]
        time.sleep(0.2)
    descendants = controller.children(recursive=True)
    assert len(rank_processes(controller, "local")) >= config.nproc
    os.killpg(proc.pid, signal.SIGINT)
    try:
        code = proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    log = open(err).read()
    assert code == 130, log[-3000:]
    assert "Traceback" not in log and log.rstrip().splitlines()[-1].startswith("interrupted")
    # multiprocessing's resource tracker exits on its own once its last client is gone.
    _, survivors = psutil.wait_procs(descendants, timeout=10)
    assert not survivors, [(p.cmdline(), p.ppid()) for p in survivors]
    latest = checkpoints.of_run(config.out_dir).latest()
    assert role_workers.checkpoint_tensors(f"{latest}/actor")  # complete and loadable
    resumed = run(dataclasses.replace(config, steps=checkpoints.read_state(latest)["step"] + 1))
    assert len(resumed) == 1


def test_a_killed_rollout_engine_is_restarted_alone_and_the_run_equals_a_straight_one(
        base, tmp_path, monkeypatch):  # noqa: F811
    """Disaggregated with sync_mode=delta, the rollout engine's rank killed (SIGKILL) while
    it generates step 2's samples: the rollout group alone is started again, the channel
    reopened and the weights sent whole (the delta bases died with the engine), and the call
    made again; the trainer's groups keep their state (max_restarts=0: a whole restart would
    have stopped the run). The Megatron engine seeds each call, so the redrawn samples are
    the same: every metric but the count, and the final actor and critic, equal a straight
    run's bitwise, and the next steps' delta syncs move what the straight run's did."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # same threads everywhere: same summation order
    short = dict(nproc=1, tensor_parallel=1, steps=3, save_every=1, max_restarts=0,
                 placement="disaggregated", sync_mode="delta")
    straight = run(dataclasses.replace(base, out_dir=str(tmp_path / "straight"), **short))
    faulted = dataclasses.replace(base, out_dir=str(tmp_path / "faulted"), **short)
    history = _run_killing_the_rollout_rank(faulted, 1)
    events = [r for r in read_metrics(faulted.out_dir) if r.get("event") in
              ("restart", "engine_restart")]
    assert [(e["event"], e["failed_step"], e["cause"]) for e in events] == [
        ("engine_restart", 2, "generate: rollout rank 0 died (exit code -9)")], events
    assert events[0]["seconds"] > 0
    assert [m.pop("fault/engine_restarts", None) for m in history] == [None, 1, 1]
    assert [_without_timings(m) for m in history] == [_without_timings(m) for m in straight]
    for role in ("actor", "critic"):
        ours = _final_weights(faulted.out_dir, role)
        theirs = _final_weights(str(tmp_path / "straight"), role)
        assert ours.keys() == theirs.keys()
        for key in ours:
            assert torch.equal(ours[key], theirs[key]), (role, key)


def test_a_rank_aborting_on_its_own_stops_the_run(base, tmp_path, monkeypatch):  # noqa: F811
    """Rank 1 aborts (SIGABRT) at the start of step 3's train call, rank 0 healthy
    (tests/rank_faults): the call has not run collective_timeout_s, so no watchdog made the
    abort; it is the rank's own doing and would happen again. The run stops naming the rank,
    though the step-2 checkpoint was there to restart from."""
    rank_faults(monkeypatch, tmp_path, "1:abort")
    config = dataclasses.replace(base, out_dir=str(tmp_path / "run"), collective_timeout_s=10.0,
                                 **FAULT_RUN)
    with pytest.raises(WorkerError, match=r"^train: colocated rank 1 died \(exit code -6\)"
                                          r"(;|$)") as stopped:
        run(config)
    assert not isinstance(stopped.value, WorkerLost)
    assert checkpoints.of_run(config.out_dir).latest().endswith("step_2")
    assert not [r for r in read_metrics(config.out_dir) if r.get("event") == "restart"]
