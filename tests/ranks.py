"""A PPO job's rank processes as seen from outside, for the tests and benches that inject
faults into them (kill, stop)."""

from __future__ import annotations

import psutil


def rank_processes(controller: psutil.Process, worker_group: str) -> list[psutil.Process]:
    """The job's running rank processes, in start order (rank 0 first; groups in the order
    they were started). Local ranks are the children of the launcher's fork server
    (megarlhf/parallel/launcher.py); Ray's are the controller's descendants named
    ray::_Rank (a Ray runtime the controller started)."""
    if worker_group == "local":
        (server,) = [p for p in controller.children()
                     if "multiprocessing.forkserver" in " ".join(p.cmdline())]
        ranks = server.children()
    else:
        ranks = [p for p in controller.children(recursive=True)
                 if "ray::_Rank" in " ".join(p.cmdline())]
    # Creation times tick in hundredths of a second: the pid orders ranks started together.
    return sorted([p for p in ranks if _running(p)], key=lambda p: (p.create_time(), p.pid))


def _running(process: psutil.Process) -> bool:
    """Not a rank of an earlier start, gone or waiting to be reaped (a restarted run's)."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
