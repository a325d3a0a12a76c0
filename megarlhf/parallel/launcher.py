"""Spawn N ranks on this machine and collect what each returns (tests, the demo, tools).

Each rank is a fresh `spawn` process with torchrun-style variables (RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so code under test meets the same rendezvous path as
under torchrun. If any rank raises, the others are terminated and a `RankError` carries the
failing rank's traceback; a run that exceeds `timeout_s` is killed rather than left hanging.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import signal
import time
import traceback
from typing import Any, Callable

from megarlhf.parallel.mesh import free_port


class RankError(RuntimeError):
    """A spawned rank raised, died or timed out."""


def _entry(fn, rank, world_size, port, env, args, kwargs, results):
    # A terminal's Ctrl-C reaches every rank too: the parent alone handles it (it stops the
    # ranks), so no rank prints a traceback of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ.update(env)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
    )
    try:
        # Plain pickle copies tensors into the message; the queue's default would share their
        # memory by file descriptor, which dies with this process before the parent reads it.
        results.put((rank, True, pickle.dumps(fn(*args, **kwargs))))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        results.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def launch_local(
    fn: Callable[..., Any],
    nprocs: int,
    *args,
    timeout_s: float = 600.0,
    env: dict[str, str] | None = None,
    **kwargs,
) -> list[Any]:
    """Run `fn(*args, **kwargs)` on `nprocs` local ranks; return the per-rank results in order.

    `fn` must be importable (module level) and its return value picklable. Each rank should
    call `megarlhf.parallel.init_mesh` (or `init_distributed`) itself.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be >= 1, got {nprocs}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    # Each rank gets an equal share of the cores; more threads than cores thrash.
    threads = str(max(1, (os.cpu_count() or 1) // nprocs))
    rank_env = {"OMP_NUM_THREADS": threads, **(env or {})}
    procs = [
        ctx.Process(
            target=_entry,
            args=(fn, r, nprocs, port, rank_env, args, kwargs, results),
            name=f"megarlhf-rank{r}",
        )
        for r in range(nprocs)
    ]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(outputs) < nprocs:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if r not in outputs and p.exitcode is not None]
                if dead:
                    # Give a rank that just exited a moment for its queued result to arrive.
                    try:
                        rank, ok, value = results.get(timeout=5.0)
                    except queue.Empty:
                        codes = {r: procs[r].exitcode for r in dead}
                        raise RankError(f"rank(s) {dead} died without a result "
                                        f"(exit codes {codes})") from None
                elif time.monotonic() > deadline:
                    missing = sorted(set(range(nprocs)) - set(outputs))
                    raise RankError(f"ranks {missing} did not finish within {timeout_s:.0f} s")
                else:
                    continue
            if not ok:
                raise RankError(f"rank {rank} of {nprocs} raised:\n{value}")
            outputs[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=10 if len(outputs) == nprocs else 0.1)
            if p.is_alive():
                p.kill()
                p.join()
    return [outputs[r] for r in range(nprocs)]
