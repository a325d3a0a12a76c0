"""Rendezvous detection (torchrun, Slurm) and the local launcher's failure reporting."""

from __future__ import annotations

import os

import pytest

from megarlhf.parallel.launcher import RankError, launch_local
from megarlhf.parallel.mesh import DistEnv, first_host

_MARK_AT_IMPORT = os.environ.get("MEGARLHF_LAUNCH_MARK")
"""Read when a rank imports this module, which it does to find its function, before that
function runs: as CUDA reads CUDA_VISIBLE_DEVICES and torch OMP_NUM_THREADS."""


@pytest.mark.parametrize("nodelist, host", [
    ("n1", "n1"),
    ("n[1-2]", "n1"),
    ("gpu[003-010,012],login1", "gpu003"),
    ("node[07,09]-ib", "node07-ib"),
    ("a1,b2", "a1"),
    ("rack[1-2]-n[01-04]", "rack1-n01"),
    ("rack[3,5]-n[7-8],rack9-n1", "rack3-n7"),
])
def test_first_host(nodelist, host):
    assert first_host(nodelist) == host


@pytest.mark.parametrize("nodelist", ["", "gpu[", "gpu[]", "gpu]1"])
def test_first_host_malformed(nodelist):
    with pytest.raises(ValueError, match="cannot parse Slurm node list"):
        first_host(nodelist)


def test_detect_torchrun(monkeypatch):
    for k, v in dict(RANK="3", WORLD_SIZE="8", LOCAL_RANK="1", MASTER_ADDR="h0",
                     MASTER_PORT="1234").items():
        monkeypatch.setenv(k, v)
    assert DistEnv.detect() == DistEnv(rank=3, world_size=8, local_rank=1, master_addr="h0",
                                       master_port=1234)


def test_detect_slurm(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    # The batch script: the job's task count, but no step, so not one of its ranks.
    for k, v in dict(SLURM_PROCID="0", SLURM_NTASKS="32", SLURM_JOB_NODELIST="gpu[10-11]",
                     SLURM_JOB_ID="4242").items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    assert DistEnv.detect().world_size == 1
    # A task of an srun step.
    for k, v in dict(SLURM_STEP_ID="0", SLURM_PROCID="5", SLURM_STEP_NUM_TASKS="16",
                     SLURM_LOCALID="5").items():
        monkeypatch.setenv(k, v)
    env = DistEnv.detect()
    assert (env.rank, env.world_size, env.local_rank, env.master_addr) == (5, 16, 5, "gpu10")
    assert env.master_port == 12000 + 4242


def _rank_value(offset):
    return int(os.environ["RANK"]) + offset


def _fails_on_rank1():
    if os.environ["RANK"] == "1":
        raise KeyError("boom on purpose")
    return 0


def _dies_on_rank0():
    if os.environ["RANK"] == "0":
        os._exit(3)
    import time

    time.sleep(30)


def test_launcher_returns_per_rank_results():
    assert launch_local(_rank_value, 2, 10) == [10, 11]


def _mark_at_import():
    return _MARK_AT_IMPORT


def test_a_rank_has_its_environment_from_its_start():
    # A rank given its environment only once its function ran saw the GPU that
    # CUDA_VISIBLE_DEVICES="" hid (device count 0, is_available() true) on an H200.
    assert launch_local(_mark_at_import, 1, env={"MEGARLHF_LAUNCH_MARK": "7"}) == ["7"]
    assert "MEGARLHF_LAUNCH_MARK" not in os.environ  # the launching process's is restored


def _threads_and_site_mark():
    import builtins

    import torch

    print(f"rank {os.environ['RANK']} writes here")
    return torch.get_num_threads(), getattr(builtins, "_megarlhf_site_mark", None)


def test_a_rank_writes_where_this_process_does_and_starts_with_its_startup_variables(
        tmp_path, monkeypatch, capfd):
    """Ranks fork from a server (parallel/launcher.py): their stdout is this process's as it is
    at their start (here the test's capture), their thread count the one their environment
    names, and what an interpreter reads only at its start (PYTHONPATH's sitecustomize) comes
    from a server started with this process's current settings."""
    (tmp_path / "sitecustomize.py").write_text("import builtins\n"
                                               "builtins._megarlhf_site_mark = 'site'\n")
    assert launch_local(_threads_and_site_mark, 1, env={"OMP_NUM_THREADS": "1"}) == [(1, None)]
    assert "rank 0 writes here" in capfd.readouterr().out
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path),
                                                      os.environ.get("PYTHONPATH", "")]))
    assert launch_local(_threads_and_site_mark, 1, env={"OMP_NUM_THREADS": "2"}) == [
        (2, "site")]
    monkeypatch.undo()
    assert launch_local(_threads_and_site_mark, 1) == [(max(1, os.cpu_count() or 1), None)]


def test_launcher_reports_failing_rank_with_traceback():
    with pytest.raises(RankError, match=r"(?s)rank 1 of 2 raised.*KeyError: 'boom on purpose'"):
        launch_local(_fails_on_rank1, 2)


def test_launcher_reports_dead_rank_without_hanging():
    with pytest.raises(RankError, match=r"rank\(s\) \[0\] died .*exit codes \{0: 3\}"):
        launch_local(_dies_on_rank0, 2, timeout_s=60)


@pytest.mark.parametrize("env, launched", [
    ({}, False),
    ({"RANK": "0", "WORLD_SIZE": "2"}, True),  # torchrun
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}, False),  # an sbatch script itself
    ({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0"}, True),  # an srun task
])
def test_started_by_launcher_tells_ranks_from_batch_scripts(env, launched):
    from megarlhf.parallel.mesh import started_by_launcher

    assert started_by_launcher(env) is launched
