"""A real two-node Slurm cluster on this machine, for the tests of the launch/ scripts.

Debian's packages (slurmctld, slurmd, slurm-client, munge) run from a private directory: a
munged with its own key and socket, a slurmctld, and one slurmd per fake node (n1, n2, both on
127.0.0.1 with their own ports). Clients find it through SLURM_CONF. Every daemon is a child
started here in the foreground and stopped by its pid; the node names go in /etc/hosts (so
`first node` rendezvous resolves) and come out again at `stop`.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

from megarlhf.parallel.mesh import free_port

NODES = ("n1", "n2")
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel", "sinfo")
HOSTS = Path("/etc/hosts")


class SlurmUnavailable(RuntimeError):
    """This machine cannot run the test cluster; the message says why."""


def missing_binaries() -> list[str]:
    return [b for b in BINARIES if shutil.which(b) is None]


def _conf(root: Path, munge_socket: Path) -> str:
    nodes = "\n".join(f"NodeName={n} NodeAddr=127.0.0.1 Port={free_port()} CPUs={os.cpu_count()}"
                      f" State=UNKNOWN" for n in NODES)
    return f"""\
ClusterName=megarlhf-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
# No cgroups in a container: processes are tracked by parentage, tasks are not bound.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobRequeue=1
# Seconds between TERM and KILL when a job is cancelled or requeued.
KillWait=30
{nodes}
PartitionName=test Nodes={",".join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self._daemons: list[subprocess.Popen] = []
        self._hosts_line: str | None = None

    # -- clients --

    def env(self, **extra: str) -> dict[str, str]:
        """The environment for Slurm commands (and, exported by sbatch, for jobs): this
        process's, without any SLURM_* of an enclosing job, pointed at this cluster."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        return {**env, "SLURM_CONF": str(self.conf), **extra}

    def run(self, *cmd: str, timeout: float = 30, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env=kw.pop("env", None) or self.env(), capture_output=True,
                              text=True, timeout=timeout, check=True, **kw)

    def submit(self, script: str, *args: str, options: tuple[str, ...] = (), cwd: Path,
               env: dict[str, str]) -> int:
        out = self.run("sbatch", "--parsable", *options, script, *args, cwd=cwd, env=env)
        return int(out.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, Restarts, ...)."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id)).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_job(self, job_id: int, states: tuple[str, ...], timeout: float,
                 pending_timeout: float = 60) -> dict[str, str]:
        """Poll until the job is in one of `states`; fail early, with Slurm's reason, when it
        stays pending (resources it asks for that the test nodes lack, say)."""
        start = time.monotonic()
        while True:
            info = self.job(job_id)
            if info["JobState"] in states:
                return info
            waited = time.monotonic() - start
            if waited > timeout or (info["JobState"] == "PENDING" and waited > pending_timeout
                                    and info.get("Reason") not in ("BeginTime", "None")):
                raise TimeoutError(f"job {job_id} still {info['JobState']} (reason "
                                   f"{info.get('Reason')}) after {waited:.0f} s, not in {states}")
            time.sleep(0.5)

    # -- daemons --

    def start(self) -> None:
        if os.geteuid() != 0:
            raise SlurmUnavailable("the test cluster's daemons run as root; not root here")
        missing = missing_binaries()
        if missing:
            raise SlurmUnavailable(f"{missing} not found; install the Debian packages "
                                   f"slurmctld slurmd slurm-client munge")
        for sub in ("state", "spool", "log", "munge"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        munge = self.root / "munge"
        munge.chmod(0o755)  # munged insists that nobody else may write next to its socket
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        socket_path = munge / "munge.socket"
        self.conf.write_text(_conf(self.root, socket_path))
        self._add_hosts()
        self._daemon("munged", "--foreground", "--force", f"--socket={socket_path}",
                     f"--key-file={key}", f"--pid-file={munge}/munged.pid",
                     f"--seed-file={munge}/munged.seed", f"--log-file={munge}/munged.log")
        self._wait(socket_path.exists, "munged made no socket", munge / "munged.log")
        self._daemon("slurmctld", "-D", "-i", "-f", str(self.conf))
        for node in NODES:
            self._daemon("slurmd", "-D", "-N", node, "-f", str(self.conf))
        self._wait(self._nodes_idle, "the nodes did not come up idle",
                   self.root / "log" / "slurmctld.log")

    def stop(self) -> None:
        """Cancel what still runs, stop the daemons by pid, take the hosts entry out and
        remove the cluster's directory (configuration, key, state, daemon logs)."""
        if any(d.poll() is None for d in self._daemons):
            subprocess.run(["scancel", "--full", "--user=root"], env=self.env(),
                           capture_output=True, timeout=30)
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and self._any_jobs():
                time.sleep(1)
        for daemon in reversed(self._daemons):  # slurmd before slurmctld before munged
            daemon.terminate()
            try:
                daemon.wait(timeout=20)
            except subprocess.TimeoutExpired:
                daemon.kill()
                daemon.wait()
        self._daemons.clear()
        self._remove_hosts()
        shutil.rmtree(self.root, ignore_errors=True)

    def _daemon(self, *cmd: str) -> None:
        with open(self.root / "log" / f"{cmd[0]}.console", "a") as log:
            self._daemons.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                                  stdin=subprocess.DEVNULL,
                                                  start_new_session=True))

    def _wait(self, ready, what: str, log: Path, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [d.args[0] for d in self._daemons if d.poll() is not None]
            if dead or time.monotonic() > deadline:
                tail = log.read_text()[-2000:] if log.exists() else "(no log)"
                raise SlurmUnavailable(f"{what}{f'; {dead} exited' if dead else ''}; "
                                       f"{log}:\n{tail}")
            time.sleep(0.5)

    def _nodes_idle(self) -> bool:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %t"], env=self.env(),
                             capture_output=True, text=True, timeout=30).stdout
        return sorted(out.split()) == sorted([*NODES, *["idle"] * len(NODES)])

    def _any_jobs(self) -> bool:
        out = subprocess.run(["squeue", "-h"], env=self.env(), capture_output=True, text=True,
                             timeout=30).stdout
        return bool(out.strip())

    def _add_hosts(self) -> None:
        try:
            if all(socket.gethostbyname(n) == "127.0.0.1" for n in NODES):
                return
        except OSError:
            pass
        self._hosts_line = f"127.0.0.1 {' '.join(NODES)}  # megarlhf test cluster {self.root}\n"
        try:
            with open(HOSTS, "a") as f:
                f.write(self._hosts_line)
        except OSError as e:
            self._hosts_line = None
            raise SlurmUnavailable(f"cannot add the test nodes to {HOSTS}: {e}") from None

    def _remove_hosts(self) -> None:
        if self._hosts_line is None:
            return
        lines = HOSTS.read_text().splitlines(keepends=True)
        HOSTS.write_text("".join(line for line in lines if line != self._hosts_line))
        self._hosts_line = None


def job_processes(job_id: int, markers: tuple[str, ...] = ()) -> list[str]:
    """Processes of a Slurm job still alive on this machine: those whose environment has its
    SLURM_JOB_ID (everything srun started and their children), or whose command line or open
    files mention one of `markers` (Ray workers rewrite their command line and environment
    block, but keep their log files in the job's Ray session directory open)."""
    return processes(markers, environ_tag=f"SLURM_JOB_ID={job_id}")


def processes(markers: tuple[str, ...], environ_tag: str | None = None) -> list[str]:
    """'pid command line' of the processes whose command line or open files mention one of
    `markers`, or whose environment holds `environ_tag`."""
    tag = environ_tag.encode() if environ_tag else None
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        proc = Path("/proc", pid)
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            environ = (proc / "environ").read_bytes().split(b"\0")
            files = [os.readlink(fd) for fd in (proc / "fd").iterdir()]
        except OSError:  # it ended while we looked, or it is not ours to read
            continue
        named = any(m in cmdline or any(m in f for f in files) for m in markers)
        if named or (tag is not None and tag in environ):
            found.append(f"{pid} {cmdline.strip()[:200]}")
    return found
