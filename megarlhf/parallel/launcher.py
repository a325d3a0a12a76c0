"""Ranks on this machine: the one way megarlhf starts them (`spawn_ranks`), and
`launch_local`, which runs a function on N ranks and collects what each returns (SFT/RM with
--nproc, the demo, tests). PPO's local worker groups start their ranks with `spawn_ranks` too.

Each rank gets torchrun-style variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT), so code meets the same rendezvous path as under torchrun, and an equal share of
the cores. In `launch_local`, if any rank raises, the others are terminated and a `RankError`
carries the failing rank's traceback; a run that exceeds `timeout_s` is killed rather than
left hanging.

Ranks are forked from multiprocessing's fork server, one process per launching process that
imported megarlhf, torch, megatron-core and transformers once, instead of each spawned
interpreter importing them again (5 s of CPU per rank on a 2-core machine: a PPO run with four
roles spent 20-30 s starting). The server is a fresh interpreter that never ran anything else,
so a fork of it holds no threads or state of the launching process. A rank starts with exactly
the environment a spawned one would have (the launching process's at that moment plus its own
variables), writes to the launching process's stdout and stderr as they are when it starts, and
sets its thread count itself, since torch read OMP_NUM_THREADS in the server. What a process
reads only when it starts (PYTHONPATH, LD_PRELOAD, OpenMP's settings) comes from the server: a
change of those in the launching process starts a new server.
Where a CUDA device is visible the server imports nothing: megatron-core's import loads
Transformer Engine, which must not be initialised before a fork, and no GPU run has shown
that it is not; ranks there import everything themselves, as spawned ones do.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import threading
import time
import traceback
from multiprocessing import forkserver
from typing import Any, Callable

from megarlhf import rank_entry
from megarlhf.parallel.mesh import free_port


class RankError(RuntimeError):
    """A rank raised, died or timed out."""


def spawn_ranks(target: Callable, rank_args: list[tuple], *, name: str,
                env: dict[str, str] | None = None, threads: int | None = None
                ) -> list[mp.process.BaseProcess]:
    """Start `target(*rank_args[r])` on local ranks r = 0..len(rank_args)-1, one process
    each, meeting at a fresh port; `env` is added to each rank's environment and `threads`
    (default: an equal share of the cores) is its torch thread count. The library log levels
    (megarlhf/logs.py) reach each rank in the environment importing megarlhf set here."""
    nprocs = len(rank_args)
    ctx = rank_context()
    port = free_port()
    # More threads than cores thrash.
    threads = threads or max(1, (os.cpu_count() or 1) // nprocs)
    procs = []
    for rank, args in enumerate(rank_args):
        environ = {**os.environ, "OMP_NUM_THREADS": str(threads), **(env or {}),
                   "RANK": str(rank), "WORLD_SIZE": str(nprocs), "LOCAL_RANK": str(rank),
                   "LOCAL_WORLD_SIZE": str(nprocs), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port)}
        proc = ctx.Process(target=rank_entry.main,
                           args=(rank_entry.Start(environ), target, args),
                           name=f"{name}-rank{rank}")
        proc.start()
        procs.append(proc)
    return procs


_START = threading.Lock()
_server_startup: dict[str, str] | None = None
"""The startup variables (`_startup_variables`) the running server was started with."""


def _startup_variables() -> dict[str, str]:
    """What a process reads once, when it starts (the interpreter's PYTHON* settings such as
    PYTHONPATH and its sitecustomize, the loader's LD_*, OpenMP's and MKL's settings) or
    when the server's preloaded modules are imported (TORCH_*): a rank can only have these
    from its server, so a change in this process starts a new server."""
    prefixes = ("PYTHON", "LD_", "OMP_", "KMP_", "MKL_", "TORCH_")
    return {k: v for k, v in os.environ.items() if k.startswith(prefixes)}


def rank_context() -> mp.context.BaseContext:
    """The multiprocessing context ranks start from (module docstring), its server running
    with this process's startup variables."""
    global _server_startup
    ctx = mp.get_context("forkserver")
    with _START:  # two groups starting in threads of one process start one server
        import torch

        if not torch.cuda.is_available():
            # What every rank imports: the engine and its checkpoints bring the architectures
            # and transformers with them (1.2 s of each rank's start when not preloaded).
            ctx.set_forkserver_preload(["megarlhf", "megatron.core", "megarlhf.engine.checkpoint"])
        startup = _startup_variables()
        if _server_startup is not None and startup != _server_startup:
            # multiprocessing's own way to end its server (its tests use it); ranks already
            # forked from it run on.
            forkserver._forkserver._stop()
        # Started here, not by the first rank's start, so the server's own environment is
        # this process's, not a rank's.
        forkserver.ensure_running()
        _server_startup = startup
    return ctx


def _entry(fn, rank, args, kwargs, results):
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
    results = rank_context().Queue()
    procs = spawn_ranks(_entry, [(fn, r, args, kwargs, results) for r in range(nprocs)],
                        name="megarlhf", env=env)
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
