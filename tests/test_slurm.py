"""The launch/ scripts on a real two-node Slurm cluster (tests/slurm_cluster.py): SFT ranks on
both nodes through srun, PPO on Ray-on-Slurm across both nodes (a node's Ray lost after the
first checkpoint: the job requeues itself and resumes, ending as a clean run), scancel
leaving no process behind, and failures reaching the job's exit code. The fast tests run the scripts under bash with stand-ins for srun and scontrol, to
check the command lines they build (container mode cannot run here: no Pyxis)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from megarlhf.configio import load_config
from megarlhf.metrics import read_metrics, read_steps
from megarlhf.ppo import checkpoints
from megarlhf.ppo.config import PPOConfig
from megarlhf.ppo.controller import run
from megarlhf.sft.loop import run_checkpoints
from tests.slurm_cluster import (SlurmCluster, SlurmUnavailable, job_processes,
                                 processes)
from tests.test_ppo import prompts_file  # noqa: F401 (a fixture: the PPO tests' prompts)
from tests.test_sft_rm import corpus  # noqa: F401 (a fixture: tokenizer and SFT data)

REPO = Path(__file__).resolve().parent.parent
LAUNCH = REPO / "launch"
# Two nodes, one task (rank or Ray node) on each, no GPUs: the scripts' #SBATCH lines ask for
# 8 GPUs per node and these options replace them.
TWO_NODES = ("--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=1", "--gpus-per-node=0",
             "--time=15")
FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
# ppo.sbatch takes whole nodes (2 CPUs each here); one CPU per Ray node leaves room for one
# rank (a bundle of one CPU), so a 2-rank run that starts at all has a rank on each node.
ONE_RANK_PER_NODE = {"RAY_CPUS_PER_NODE": "1"}
JOB_TIMEOUT = 420  # seconds; one PPO run took 40-100 s here, on 2 cores shared with others


@pytest.fixture(scope="session")
def slurm(tmp_path_factory):
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
    except SlurmUnavailable as e:
        cluster.stop()
        pytest.skip(f"no local Slurm cluster: {e}")
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def ray_root():
    """Ray's session directories; short, since its socket paths must fit in 107 bytes."""
    path = tempfile.mkdtemp(prefix="rs", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def job_env(slurm, ray_root):
    """What a user's shell has at submission: the venv's commands on PATH (and this checkout
    importable, for the tests' reward function)."""
    return slurm.env(PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}",
                     PYTHONPATH=str(REPO), RAY_TEMP_ROOT=ray_root)


def _submit(slurm, script, *args, cwd: Path, env) -> int:
    """sbatch as a user types it: `launch/SCRIPT` relative to the submit directory (here a
    link to the checkout's launch/), which the script must resolve to find common.sh."""
    if not (cwd / "launch").exists():
        (cwd / "launch").symlink_to(LAUNCH)
    return slurm.submit(f"launch/{script}", *map(str, args), options=TWO_NODES, cwd=cwd,
                        env=env)


def _run_job(slurm, script, *args, cwd, env) -> tuple[int, dict]:
    """Submit and wait for the end: (job id, its scontrol record: JobState, ExitCode ...)."""
    job = _submit(slurm, script, *args, cwd=cwd, env=env)
    return job, slurm.wait_job(job, FINAL, JOB_TIMEOUT)


def _job_log(cwd: Path, name: str, job_id: int) -> str:
    path = cwd / "logs" / f"{name}-{job_id}" / "job.log"
    return path.read_text() if path.exists() else f"(no {path})"


def _sft_config(tmp_path: Path, corpus: dict) -> Path:  # noqa: F811
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"preset": "tiny", "overrides": {"vocab_size": 256}, "layer_spec": "local"},
        "data": {"train": {"path": corpus["sft"]}, "tokenizer": corpus["sp"],
                 "max_length": 48},
        "train": {"output_dir": str(tmp_path / "sft"), "steps": 2, "global_batch_size": 4},
        # TP2 needs both ranks, so a run that finishes proves the two nodes met.
        "parallel": {"tensor_parallel": 2}}))
    return path


@pytest.mark.slow
def test_sft_runs_one_rank_on_each_node(slurm, job_env, tmp_path, corpus):  # noqa: F811
    config = _sft_config(tmp_path, corpus)
    job, info = _run_job(slurm, "train.sbatch", "sft", config, cwd=tmp_path, env=job_env)
    log = _job_log(tmp_path, "megarlhf-train", job)
    assert info["JobState"] == "COMPLETED", log[-3000:]
    assert info["NodeList"] == "n[1-2]"
    assert "rendezvous n1:" in log and "2 ranks" in log
    final = run_checkpoints(str(tmp_path / "sft")).latest()
    assert int(Path(final).name.split("_")[1]) == 2, final
    logs = tmp_path / "logs" / f"megarlhf-train-{job}"
    assert sorted(p.name for p in logs.iterdir()) == [
        "job.log", "rank-0.exit", "rank-0.log", "rank-1.exit", "rank-1.log"]
    assert [(logs / f"rank-{r}.exit").read_text() for r in (0, 1)] == ["0\n", "0\n"]


@pytest.mark.slow
def test_a_failing_stage_fails_the_job_with_its_exit_code(slurm, job_env, tmp_path,
                                                          corpus):  # noqa: F811
    config = _sft_config(tmp_path, corpus)
    job, info = _run_job(slurm, "train.sbatch", "sft", config, "train.no_such_key=1",
                         cwd=tmp_path, env=job_env)
    log = _job_log(tmp_path, "megarlhf-train", job)
    # 2: the CLI's exit code for a bad config (0:0 or a signal would mean it got lost)
    assert (info["JobState"], info["ExitCode"]) == ("FAILED", "2:0"), log[-3000:]
    # Refused by the preflight step, before any rank started, in the command's own words.
    assert "preflight failed (exit code 2): nothing was started" in log
    assert "unknown key(s) ['no_such_key']" in log and "rank-0.log" not in " ".join(
        p.name for p in (tmp_path / "logs" / f"megarlhf-train-{job}").iterdir())


@pytest.fixture
def ppo_recipe(lm_ref, prompts_file, tmp_path):  # noqa: F811 (pytest fixture argument)
    """GRPO on the PPO tests' task (no critic: less to load), 2 ranks."""
    path = tmp_path / "ppo.yaml"
    path.write_text(yaml.safe_dump({
        "actor": lm_ref, "prompts": prompts_file, "out_dir": str(tmp_path / "ppo"),
        "reward_fn": "tests.ppo_tasks:low_token_fraction", "algorithm": "grpo", "nproc": 2,
        "prompts_per_step": 2, "samples_per_prompt": 2, "max_new_tokens": 4}))
    return path


def _wait_for(condition, what: str, timeout: float, log) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {timeout} s:\n{log()[-3000:]}"
        time.sleep(0.5)


@pytest.mark.slow
def test_a_lost_ray_node_requeues_the_job_which_finishes_as_a_clean_run(
        slurm, job_env, ppo_recipe, ray_root, tmp_path, monkeypatch):
    """PPO on Ray across both nodes, a rank on each. After the first checkpoint node n2's Ray
    processes are killed (its raylet and the rank on it): the controller restarts the run,
    finds no room for two ranks on n1 for restart_wait_s, exits 75, and ppo.sbatch requeues
    the job. Run again on both nodes, it resumes from its checkpoint and ends with the
    weights and step metrics of a run never interrupted (local ranks at one thread each, as
    Ray's here)."""
    from tests.test_ppo import _assert_same_weights, _without_timings

    out = tmp_path / "ppo"
    job = _submit(slurm, "ppo.sbatch", ppo_recipe, "steps=6", "save_every=2",
                  "restart_wait_s=10", "restart_backoff=1", cwd=tmp_path,
                  env={**job_env, **ONE_RANK_PER_NODE})
    log = lambda: _job_log(tmp_path, "megarlhf-ppo", job)  # noqa: E731
    _wait_for(lambda: checkpoints.of_run(str(out)).latest() is not None, "a first checkpoint",
              JOB_TIMEOUT, log)
    # n2's Ray node: its raylet, its workers and the `ray start` that launched them.
    lost = processes((f"{ray_root}/ray-{job}-n2",))
    assert any("raylet" in line for line in lost), lost
    for line in lost:
        try:
            os.kill(int(line.split()[0]), signal.SIGKILL)
        except ProcessLookupError:
            pass
    # Slurm holds a requeued job back ~2 minutes (BeginTime); release it now.
    info = slurm.wait_job(job, ("PENDING", *FINAL), JOB_TIMEOUT)
    assert info["JobState"] == "PENDING", log()[-3000:]  # requeued, not ended
    slurm.run("scontrol", "update", f"JobId={job}", "StartTime=now")
    info = slurm.wait_job(job, FINAL, JOB_TIMEOUT)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log()[-3000:]

    text = log()
    assert text.count("ray: 2/2 nodes up") == 2  # both runs had a Ray node on each node
    assert "requeueing the job (requeue 1 of at most 3)" in text, text[-3000:]
    assert "(restart 1)" in text
    restart, = [r for r in read_metrics(str(out)) if r.get("event") == "restart"]
    # Whichever rank Ray placed on n2.
    assert re.fullmatch(r"\w+: colocated rank \d's Ray actor died", restart["cause"]), restart
    resumed = int(text.split("resumed from ")[1].split("(step ")[1].split(")")[0])
    assert resumed >= 2 and checkpoints.of_run(str(out)).latest().endswith("step_6")
    assert job_processes(job, (f"{ray_root}/ray-{job}-",)) == []

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    straight = load_config(PPOConfig, str(ppo_recipe), ["steps=6", "save_every=2",
                                                        f"out_dir={tmp_path / 'straight'}"])
    run(straight)
    ours, theirs = read_steps(str(out)), read_steps(straight.out_dir)
    # The first run logged steps 1.. up to where its rank was lost; the second continued
    # after the checkpoint it resumed from.
    assert [m["step"] for m in ours[-(6 - resumed):]] == list(range(resumed + 1, 7)), ours
    for mine, reference in zip(ours[-(6 - resumed):], theirs[resumed:]):
        assert _without_timings(mine) == _without_timings(reference)
    _assert_same_weights(str(out), straight.out_dir)


@pytest.mark.slow
def test_scancel_leaves_no_process_of_the_job(slurm, job_env, ppo_recipe, ray_root, tmp_path):
    out = tmp_path / "ppo"
    job = _submit(slurm, "ppo.sbatch", ppo_recipe, "steps=100000", cwd=tmp_path,
                  env={**job_env, **ONE_RANK_PER_NODE})
    log = lambda: _job_log(tmp_path, "megarlhf-ppo", job)  # noqa: E731
    _wait_for(lambda: (out / "metrics.jsonl").exists() and read_steps(str(out)),
              "a first PPO step", JOB_TIMEOUT, log)
    markers = (f"{ray_root}/ray-{job}-",)
    running = "\n".join(job_processes(job, markers))
    # The check below sees the job's processes: Ray on both nodes, the ranks, the controller.
    for name in ("gcs_server", f"ray-{job}-n1", f"ray-{job}-n2", "ray::_Rank", "megarlhf ppo"):
        assert name in running, (name, running)

    slurm.run("scancel", str(job))
    slurm.wait_job(job, ("CANCELLED",), 120)
    _wait_for(lambda: not job_processes(job, markers), "every process of the job gone", 90,
              lambda: "\n".join(job_processes(job, markers)))
    assert "stopping the controller and Ray on n1 n2" in log()


# -- fast: the command lines, with stand-ins for the Slurm commands --

FAKE_SRUN = """#!/bin/bash
args="$*"
echo "srun ${args//$'\n'/ }" >>"$FAKE_LOG"
# The head's port probe runs for real, here, under the tests' Python.
for ((i = 1; i < $#; i++)); do
    [[ ${!i} == */ray_port.py ]] && exec "$FAKE_PYTHON" "${@:i}"
done
# The controller's or a rank's exit code; the preflight, Ray nodes and the join check succeed.
[[ " $* " =~ \ (ppo|sft|rm|dpo)\  && " $* " != *" --dry-run "* ]] && exit "${FAKE_RC:-0}"
exit 0
"""
FAKE_SCONTROL = """#!/bin/bash
[[ $1 == show && $2 == hostnames ]] && printf 'n1\\nn2\\n'
[[ $1 == requeue ]] && echo "scontrol $*" >>"$FAKE_LOG"
exit 0
"""


def _fake_job(tmp_path: Path, script: str, *args: str, **env: str):
    """Run a launch script under bash as Slurm would (job variables set), with srun,
    scontrol and scancel replaced: (exit code, the srun command lines)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL),
                       ("scancel", "#!/bin/bash\n")):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    fake_log = tmp_path / "srun.log"
    fake_log.unlink(missing_ok=True)
    job = {"SLURM_JOB_ID": "77", "SLURM_JOB_NAME": "fake", "SLURM_SUBMIT_DIR": str(tmp_path),
           "SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NTASKS": "2", "SLURM_CPUS_ON_NODE": "4",
           "LAUNCH_DIR": str(LAUNCH), "FAKE_LOG": str(fake_log), "FAKE_PYTHON": sys.executable,
           "PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": str(tmp_path)}
    run = subprocess.run(["bash", str(LAUNCH / script), *args], env={**job, **env},
                         capture_output=True, text=True, timeout=60, cwd=tmp_path)
    return run.returncode, fake_log.read_text().splitlines() if fake_log.exists() else []


@pytest.mark.parametrize("script, args", [("train.sbatch", ("sft", "c.yaml")),
                                          ("ppo.sbatch", ("r.yaml",))])
def test_container_mode_runs_every_step_in_the_image(tmp_path, script, args):
    rc, bare = _fake_job(tmp_path, script, *args)
    assert rc == 0 and bare and not any("--container" in line for line in bare), bare
    rc, contained = _fake_job(tmp_path, script, *args, CONTAINER_IMAGE="nvcr.io#org/img:1")
    # First, a step that unpacks the image on both nodes; then the same steps as bare.
    assert rc == 0 and len(contained) == len(bare) + 1
    assert "--nodes=2 --ntasks=2" in contained[0] and contained[0].endswith(" true")
    for line in contained:
        assert "--container-image=nvcr.io#org/img:1" in line, line
        assert "--container-name=megarlhf-77" in line, line
        assert f"--container-mounts={tmp_path}," in line, line


@pytest.mark.parametrize("script, args", [("train.sbatch", ("sft", "c.yaml")),
                                          ("train.sbatch", ("dpo", "c.yaml")),
                                          ("ppo.sbatch", ("r.yaml",))])
def test_the_job_exit_code_is_the_stage_exit_code(tmp_path, script, args):
    assert _fake_job(tmp_path, script, *args, FAKE_RC="3")[0] == 3


@pytest.mark.parametrize("requeues, requeued", [("0", True), ("3", False)])
def test_no_room_after_a_fault_requeues_the_ppo_job_up_to_requeue_limit(tmp_path, requeues,
                                                                        requeued):
    """The controller's exit code 75 (a lost node left too little room): the script requeues
    the job unless SLURM_RESTART_COUNT reached REQUEUE_LIMIT (3); the job's code stays 75."""
    rc, lines = _fake_job(tmp_path, "ppo.sbatch", "r.yaml", FAKE_RC="75",
                          SLURM_RESTART_COUNT=requeues)
    assert rc == 75
    assert ("scontrol requeue 77" in lines) == requeued, lines


def test_ppo_starts_ray_on_each_node_then_the_controller(tmp_path):
    # The default head port (40000 + job id 77) taken on the head node: the next free one.
    with _listening(40077):
        rc, lines = _fake_job(tmp_path, "ppo.sbatch", "r.yaml", "steps=5",
                              PYTHON="/opt/py/python")
    assert rc == 0
    assert len(lines) == 7, lines
    # First the preflight, alone; then steps started in the background log in any order.
    assert lines[0].endswith("ppo --config r.yaml steps=5 worker_group=ray --dry-run")
    assert "--nodes=1 --ntasks=1 --nodelist=n1" in lines[0]
    probe, head, worker, wait1, wait2, controller = (
        next(line for line in lines[1:] if key in line)
        for key in ("ray_port.py", "--head", "--address=", "ray_wait.py 1 ", "ray_wait.py 2 ",
                    " ppo "))
    assert "--nodelist=n1" in probe and probe.endswith("ray_port.py 40077")
    port = int(re.search(r"--head --port=(\d+) ", head)[1])
    assert 40077 < port < 40077 + 100 and "--nodelist=n1" in head
    assert "--exclude=n1" in worker and f"--address=n1:{port}" in worker
    assert "--nodelist=n1" in wait1 and "--nodelist=n1" in wait2
    assert controller.endswith("ppo --config r.yaml steps=5 worker_group=ray")
    assert "--num-cpus=4" in head and "--num-cpus=4" in worker
    # Every Ray node and the controller run the Python named by PYTHON, not PATH's.
    for line in (head, worker):
        assert "-m ray.scripts.scripts start" in line and " /opt/py/python " in line, line
    assert "/opt/py/python ray_wait.py" in wait1.replace(str(LAUNCH) + "/", "")
    assert (tmp_path / "logs" / "fake-77" / "job.log").exists()


@contextlib.contextmanager
def _listening(port: int = 0):
    """A socket listening on PORT (0: a free one), as another Ray's server holds it: yields
    the port. A PORT some other process holds already is as good."""
    with socket.socket() as sock:
        with contextlib.suppress(OSError):
            sock.bind(("", port))
            sock.listen()
        yield port or sock.getsockname()[1]


def _ray_port(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(LAUNCH / "ray_port.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=30)


def test_the_head_port_probe_moves_off_a_port_in_use_unless_the_user_set_it():
    with _listening() as port:
        moved, refused = _ray_port(port), _ray_port(port, "--exact")
    assert moved.returncode == 0 and port < int(moved.stdout) <= port + 100, moved
    with socket.socket() as sock:  # what it printed is free: this listens on it
        sock.bind(("", int(moved.stdout)))
        sock.listen()
    # RAY_PORT set by the user: refused in one line naming it, nothing printed to use.
    assert (refused.returncode, refused.stdout) == (1, ""), refused
    assert refused.stderr.startswith(f"RAY_PORT={port} is in use on ")
    assert refused.stderr.count("\n") == 1
    # Released, the port itself, either way.
    assert [_ray_port(port, *exact).stdout for exact in ((), ("--exact",))] == [f"{port}\n"] * 2


def test_a_taken_ray_port_set_by_the_user_fails_the_ppo_job_before_ray_starts(tmp_path):
    with _listening() as port:
        rc, lines = _fake_job(tmp_path, "ppo.sbatch", "r.yaml", RAY_PORT=str(port))
    assert rc == 1 and not any("ray.scripts.scripts start" in line for line in lines), lines
    assert f"RAY_PORT={port} is in use on " in (tmp_path / "logs" / "fake-77" / "job.log"
                                                ).read_text()
