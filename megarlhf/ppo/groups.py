"""Worker groups: the controller's handle on the ranks of the job.

`call(method, *args)` runs `PPOWorker.method(*args)` on every rank and returns rank 0's result
(all ranks compute the same). A rank that raises or dies stops the call with a `WorkerError`
naming the rank and carrying its traceback; the group is then shut down, so no rank is left
waiting in a collective.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time
import traceback

from megarlhf.parallel.mesh import free_port


class WorkerError(RuntimeError):
    """A rank of the PPO job raised or died."""


def _serve(rank: int, world_size: int, port: int, config, conn) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), VLLM_ENABLE_V1_MULTIPROCESSING="0")
    try:
        from megarlhf.ppo.worker import PPOWorker

        worker = PPOWorker(config)
        conn.send((True, None))
    except BaseException:  # noqa: BLE001 - the controller must see every failure
        conn.send((False, traceback.format_exc()))
        return
    while True:
        method, args = conn.recv()
        if method is None:
            break
        try:
            conn.send((True, getattr(worker, method)(*args)))
        except BaseException:  # noqa: BLE001
            conn.send((False, traceback.format_exc()))
            return
    worker.shutdown()


class LocalWorkerGroup:
    """`config.nproc` spawned processes on this machine, gloo/NCCL between them."""

    def __init__(self, config, *, timeout_s: float = 1800.0):
        self.timeout_s = timeout_s
        ctx = mp.get_context("spawn")
        port = free_port()
        self._conns, self._procs = [], []
        os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1)
                                                          // config.nproc)))
        for rank in range(config.nproc):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(rank, config.nproc, port, config, child),
                               name=f"megarlhf-ppo-rank{rank}")
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        self._collect("start-up")

    def call(self, method: str, *args):
        for conn in self._conns:
            conn.send((method, args))
        return self._collect(method)[0]

    def _collect(self, what: str) -> list:
        results = [None] * len(self._conns)
        pending = set(range(len(self._conns)))
        while pending:
            ready = mp.connection.wait([self._conns[r] for r in pending] +
                                       [self._procs[r].sentinel for r in pending],
                                       timeout=self.timeout_s)
            if not ready:
                self._reap(grace_s=0)
                raise WorkerError(f"{what}: ranks {sorted(pending)} did not answer within "
                                  f"{self.timeout_s:.0f} s")
            for rank in sorted(pending):
                conn, proc = self._conns[rank], self._procs[rank]
                if conn.poll():
                    ok, value = conn.recv()
                    if not ok:
                        self._reap(grace_s=0)
                        raise WorkerError(f"{what} failed on rank {rank}:\n{value}")
                    results[rank] = value
                    pending.discard(rank)
                elif proc.exitcode is not None:
                    self._reap(grace_s=0)
                    raise WorkerError(f"{what}: rank {rank} died (exit code {proc.exitcode})")
        return results

    def shutdown(self) -> None:
        """Ask every rank to stop (engines shut down cleanly), then kill what is left."""
        for conn, proc in zip(self._conns, self._procs):
            if proc.is_alive():
                try:
                    conn.send((None, ()))
                except (BrokenPipeError, OSError):
                    pass
        self._reap(grace_s=30)

    def _reap(self, grace_s: float) -> None:
        """Join the ranks within one shared grace period and kill the rest: after a failure
        (grace 0) the others are stuck in a collective and would never return."""
        deadline = time.monotonic() + grace_s
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
