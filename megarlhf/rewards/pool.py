"""Reward calls in worker processes, each call given at most `timeout` seconds.

User checkers hang (a regex backtracking forever, a sandbox that never answers, an infinite
loop on a malformed answer). A call past its deadline has its worker killed (its whole process
group, so a checker's own subprocesses go too) and is reported as timed out; the run goes on
and a fresh worker takes the next call. A worker killed from outside (SIGKILL: the
out-of-memory killer, an operator; SIGTERM) gets its call again in a fresh worker, up to
WORKER_RETRIES times (counted: `restarts`); a worker that dies any other way, or keeps being
killed on the same call, is an error. Workers are spawned, not forked: the controller holds
threads (torch, Ray) that a fork would copy in an unknown state.
"""

from __future__ import annotations

import collections
import dataclasses
import multiprocessing
import os
import signal
import time
import traceback
from multiprocessing.connection import wait
from typing import Any


@dataclasses.dataclass(frozen=True)
class Outcome:
    kind: str
    """'ok', 'error' (the call raised, or its worker died) or 'timeout'."""
    value: Any = None
    """'ok': what the function returned; 'error': the one-line description."""


WORKER_RETRIES = 2
KILLED = (-signal.SIGKILL, -signal.SIGTERM)


class CallPool:
    def __init__(self, workers: int, timeout: float):
        if workers < 1 or not timeout > 0:
            raise ValueError(f"a reward pool needs workers >= 1 and timeout > 0, got "
                             f"{workers}, {timeout}")
        self.timeout = timeout
        self.restarts = 0
        """Calls given again after their worker was killed from outside (since the pool
        started)."""
        self._ctx = multiprocessing.get_context("spawn")
        self._workers: list[_Worker | None] = [None] * workers

    def run(self, calls: list[tuple[str, tuple, dict]]) -> list[Outcome]:
        """Outcomes of `calls` ((spec, args, kwargs) each), in order."""
        pending = collections.deque(enumerate(calls))
        running: dict[int, tuple[int, float]] = {}  # worker slot -> (call, deadline)
        outcomes: list[Outcome | None] = [None] * len(calls)
        killed = collections.Counter()  # call -> its workers killed from outside
        while pending or running:
            for slot in range(len(self._workers)):
                if slot in running or not pending:
                    continue
                index, call = pending.popleft()
                try:
                    self._worker(slot).conn.send(call)
                except (BrokenPipeError, OSError):  # killed while idle, between calls
                    self._stop(slot)
                    self.restarts += 1
                    self._worker(slot).conn.send(call)
                running[slot] = (index, time.monotonic() + self.timeout)
            by_conn = {self._workers[slot].conn: slot for slot in running}
            nearest = min(deadline for _, deadline in running.values())
            for conn in wait(list(by_conn), timeout=max(0.0, nearest - time.monotonic())):
                slot = by_conn[conn]
                index, _ = running.pop(slot)
                try:
                    kind, value = conn.recv()
                except (EOFError, OSError):
                    # The pipe closes as the process exits, maybe before it can be reaped.
                    process = self._workers[slot].process
                    process.join(timeout=5)
                    code = process.exitcode
                    self._stop(slot)
                    if code in KILLED and killed[index] < WORKER_RETRIES:
                        killed[index] += 1
                        self.restarts += 1
                        pending.appendleft((index, calls[index]))  # again, in a fresh worker
                        continue
                    kind, value = "error", f"its worker process died (exit code {code})" + (
                        f", killed {killed[index] + 1} times on this call" if code in KILLED
                        else "")
                outcomes[index] = Outcome(kind, value)
            now = time.monotonic()
            for slot, (index, deadline) in list(running.items()):
                if now >= deadline:
                    running.pop(slot)
                    self._stop(slot)
                    outcomes[index] = Outcome("timeout")
        return outcomes

    def close(self) -> None:
        for slot in range(len(self._workers)):
            self._stop(slot)

    def _worker(self, slot: int) -> "_Worker":
        if self._workers[slot] is None:
            parent, child = self._ctx.Pipe()
            process = self._ctx.Process(target=_serve, args=(child,), daemon=True,
                                        name=f"megarlhf-reward-{slot}")
            process.start()
            child.close()
            self._workers[slot] = _Worker(process, parent)
        return self._workers[slot]

    def _stop(self, slot: int) -> None:
        worker, self._workers[slot] = self._workers[slot], None
        if worker is None:
            return
        worker.conn.close()
        if worker.process.is_alive():
            try:
                os.killpg(worker.process.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                worker.process.kill()
        worker.process.join(timeout=10)


@dataclasses.dataclass
class _Worker:
    process: Any
    conn: Any


def _serve(conn) -> None:
    """A worker: load each call's function once, call it, send back what it returned or
    the one line its exception makes. Ends when the controller's end of the pipe closes."""
    os.setpgrp()  # its own process group: a timeout kills the checker's children too
    from megarlhf.rewards.calls import load

    functions = {}
    while True:
        try:
            spec, args, kwargs = conn.recv()
        except (EOFError, OSError):
            return
        try:
            fn = functions.get(spec) or functions.setdefault(spec, load(spec))
            reply = ("ok", fn(*args, **kwargs))
        except Exception as e:  # the user's code: report it, keep serving
            frames = traceback.extract_tb(e.__traceback__)
            where = f" ({frames[-1].filename}:{frames[-1].lineno})" if frames else ""
            reply = ("error", f"raised {type(e).__name__}: {e}{where}")
        try:
            conn.send(reply)
        except Exception as e:  # e.g. a value pickle cannot carry
            conn.send(("error", f"returned a value that cannot be sent back "
                                f"({type(e).__name__}: {e})"))
