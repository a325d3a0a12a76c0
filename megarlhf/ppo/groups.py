"""Worker groups of spawned processes on this machine: the controller's handle on their ranks.

A group is `nproc` ranks forming a torch.distributed world of their own (each group meets at
its own port), each running one `PPOWorker`. `group.async_call(method, *args)` sends the call
to every rank and returns at once; `LocalBackend.wait_all(calls)` then waits for several calls,
of several groups that meanwhile run concurrently, and returns per rank (result, seconds
spent in the method); every rank computes the same result, so only rank 0 sends it. A rank
that raises or dies ends the wait with a `WorkerError` naming its group and rank and carrying
its traceback; the caller then kills every group, so no rank is left waiting in a collective.
"""

from __future__ import annotations

import copyreg
import io
import multiprocessing as mp
import os
import pickle
import re
import signal
import sys
import time
import traceback

import psutil
import torch

from megarlhf.parallel.launcher import spawn_ranks
from megarlhf.parallel.mesh import free_port


class WorkerError(RuntimeError):
    """A rank of the PPO job raised or died."""


class WorkerLost(WorkerError):
    """A rank was stopped from outside (killed, OOM-killed) or stopped answering (a hang):
    nothing its code did, so the run may go on from its last checkpoint (controller,
    max_restarts). `cause`: the one line naming it; `kind`: what makes two faults the same
    one (the cause, or for a hang the call that hung, however it was caught)."""

    def __init__(self, message: str, cause: str, kind: str | None = None):
        super().__init__(message)
        self.cause, self.kind = cause, kind or cause

    def __reduce__(self):
        return type(self), (str(self), self.cause, self.kind)


def hang(what: str) -> str:
    """The kind of a hang in call `what`: a peer's collective timing out or losing its peer,
    NCCL's watchdog aborting a rank, and the phase passing its deadline are the same fault."""
    return f"{what}: hang"


class CollectiveFailed(WorkerLost):
    """A rank's collective failed because of a peer (`collective_failed`)."""


def collective_failed(what: str, group: str, rank: int, detail: str, how: str) -> WorkerLost:
    """Rank `rank` of `group` failed in a collective of call `what` because of a peer (`how`:
    TIMED_OUT or PEER_GONE, as `peer_failure` says): `detail`, its traceback."""
    cause = f"{what}: a collective of {group} {how}"
    return CollectiveFailed(f"{cause}; rank {rank}:\n{detail}", cause, hang(what))


OWN_FAILURE_GRACE_S = 2.0


def own_failure(calls: list, peer: CollectiveFailed,
                grace_s: float = OWN_FAILURE_GRACE_S) -> WorkerError:
    """What to raise for `peer`, a collective failed because of a peer: a rank that raises
    reports its error and exits with code 0 (no death names it), and its peers' collectives
    then fail for a lost peer, one of which may be read first (a lower rank, an earlier
    group). Every rank still pending gets `grace_s` to report: a rank's own failure (a bug,
    bad input, a death) is the cause and is returned; else `peer`."""
    deadline = time.monotonic() + grace_s
    while any(call.pending for call in calls) and time.monotonic() < deadline:
        for call in calls:
            try:
                call.collect()
            except CollectiveFailed:
                continue
            except WorkerError as own:
                return own
        time.sleep(0.05)
    return peer


def past_deadline(what: str, late: str, timeout_s: float) -> WorkerLost:
    """Call `what` passed its deadline; `late`: the ranks that did not answer (the cause
    leaves the deadline out, so the same hang twice reads the same)."""
    cause = f"{what}: {late} did not answer"
    return WorkerLost(f"{cause} within {timeout_s:.0f} s", cause, hang(what))


LOST_EXIT_CODES = (-signal.SIGKILL, -signal.SIGTERM)
"""How a rank stopped from outside exits (the kernel's out-of-memory killer, an operator, a
node going down). Any other exit (a segfault, an exit code) is the rank's own doing and would
happen again; so is an abort, unless NCCL's watchdog may have made it (`LocalCall._death`)."""

ABORTED = -signal.SIGABRT
"""How a rank exits that NCCL's watchdog aborts (TORCH_NCCL_ASYNC_ERROR_HANDLING, set in
megarlhf/parallel/mesh.py): its collective waited collective_timeout_s for a peer."""


class WorkerInputError(WorkerError, ValueError):
    """A rank met bad input (a corrupt or missing file, a read-only disk...): the CLI prints
    its one-line message; the rank's traceback is kept as a note (MEGARLHF_DEBUG=1 shows it)."""


def _failure() -> tuple[str, str | None, str | None]:
    """The current exception as (traceback, one-line message if it is an expected one,
    how a collective failed because of a peer, if it did: `peer_failure`)."""
    from megarlhf.errors import describe

    e = sys.exc_info()[1]
    expected = isinstance(e, (ValueError, OSError)) and not isinstance(e, WorkerError)
    return traceback.format_exc(), describe(e) if expected else None, peer_failure(e)


TIMED_OUT = "timed out (a rank stopped answering)"
PEER_GONE = "lost a peer (a rank's process is gone)"

_PEER_FAILURES = (
    # A peer that never came: gloo's "Timed out waiting <ms> for recv operation", NCCL's
    # "... ran for <ms> milliseconds before timing out" (a DistBackendError, where NCCL
    # raises rather than aborting the rank), a store's "wait timeout after <ms>" or "Socket
    # Timeout" (config.collective_timeout_s).
    (TIMED_OUT, re.compile(r"timed out|timing out|wait timeout|socket timeout", re.I)),
    # A peer that is gone: gloo's "Connection closed by peer" / "Connection reset by peer",
    # NCCL's "remote process exited or there was a network error" (ncclRemoteError) and
    # "NCCL communicator was aborted" (its watchdog tore the communicator down).
    (PEER_GONE, re.compile(r"(closed|reset) by peer|remote process exit|ncclRemoteError|"
                           r"communicator was aborted", re.I)),
)


def peer_failure(e: BaseException | None) -> str | None:
    """How torch.distributed failed because of a peer, if `e` or an exception it was raised
    from says it did: TIMED_OUT or PEER_GONE (`_PEER_FAILURES`); None for anything else.
    The rank itself did nothing wrong: a peer hung, stopped or died."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, RuntimeError):
            for how, pattern in _PEER_FAILURES:
                if pattern.search(str(e)):
                    return how
        e = e.__cause__ or e.__context__
    return None


_NUMPY_DTYPES = {torch.float64, torch.float32, torch.float16, torch.int64, torch.int32,
                 torch.int16, torch.int8, torch.uint8, torch.bool}


def _reduce_tensor(t: torch.Tensor):
    """Tensors travel as host numpy arrays: the controller holds no device (a CUDA tensor
    would arrive on a GPU it never chose, or fail where it has none), and torch's own pickling
    costs ~0.15 ms per tensor (it writes a small torch.save archive each), 15x the array."""
    if t.device.type != "cpu":
        t = t.detach().cpu()
    if t.requires_grad or t.layout != torch.strided or t.dtype not in _NUMPY_DTYPES:
        return t.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    return torch.from_numpy, (t.numpy(),)


def dumps(obj) -> bytes:
    """A pickle of a call's arguments or result (tensors as plain arrays, see above)."""
    out = io.BytesIO()
    pickler = pickle.Pickler(out, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = {**copyreg.dispatch_table, torch.Tensor: _reduce_tensor}
    pickler.dump(obj)
    return out.getvalue()


# Messages are plain pickles: a Connection's own pickler would move every tensor through a
# shared-memory file and a passed descriptor, which costs more than copying batch-sized data.
def _send(conn, message) -> None:
    conn.send_bytes(dumps(message))


def _recv(conn):
    return pickle.loads(conn.recv_bytes())


def _serve(rank: int, worker_args: tuple, conn) -> None:
    try:
        from megarlhf.ppo.worker import PPOWorker

        start = time.perf_counter()
        worker = PPOWorker(*worker_args)
        _send(conn, (True, (None, time.perf_counter() - start)))
    except BaseException:  # noqa: BLE001 - the controller must see every failure
        _send(conn, (False, _failure()))
        return
    while True:
        method, args = _recv(conn)
        if method is None:
            break
        try:
            start = time.perf_counter()
            value = getattr(worker, method)(*args)
            # Every rank computes the same result: only rank 0's travels.
            _send(conn, (True, (value if rank == 0 else None, time.perf_counter() - start)))
        except BaseException:  # noqa: BLE001
            _send(conn, (False, _failure()))
            return
    worker.shutdown()


class LocalCall:
    """One method running on every rank of a group; filled in by `LocalBackend.wait_all`."""

    def __init__(self, group: "LocalWorkerGroup", what: str):
        self.group, self.what = group, what
        self.results: list = [None] * group.nproc
        self.pending = set(range(group.nproc))
        self.started = time.monotonic()

    def waitables(self) -> list:
        return [w for r in self.pending
                for w in (self.group.conns[r], self.group.procs[r].sentinel)]

    def collect(self) -> None:
        """Take every answer that has arrived; raise if a rank failed or died."""
        for rank in sorted(self.pending):
            conn, proc = self.group.conns[rank], self.group.procs[rank]
            if conn.poll():
                try:
                    ok, value = _recv(conn)
                except (EOFError, ConnectionError):  # its end of the pipe closed or reset
                    self.raise_closed(rank)
                if not ok:
                    trace, message, how = value
                    self.pending.discard(rank)  # it answered: not a peer that hung
                    self._raise_if_a_rank_died(f"; then rank {rank} failed:\n{trace}")
                    if how:  # a peer hung, stopped or died: nothing this rank did
                        raise collective_failed(self.what, self.group.name, rank, trace, how)
                    if message is not None:
                        error = WorkerInputError(f"{self.what} on {self.group.name} rank "
                                                 f"{rank}: {message}")
                        error.add_note(trace)
                        raise error
                    raise WorkerError(f"{self.what} failed on {self.group.name} rank "
                                      f"{rank}:\n{trace}")
                self.results[rank] = value
                self.pending.discard(rank)
            elif proc.exitcode is not None:
                self._raise_if_a_rank_died("", grace_s=0.0)  # a killed peer is the cause
                raise self._death(rank, proc.exitcode)

    def raise_closed(self, rank: int) -> None:
        """Rank `rank`'s pipe closed: the rank is gone. Name the rank that died."""
        self._raise_if_a_rank_died("", grace_s=10.0)
        raise WorkerError(f"{self.what}: {self.group.name} rank {rank} closed its pipe "
                          f"without an answer") from None

    def _death(self, rank: int, code: int, then: str = "") -> WorkerError:
        cause = f"{self.what}: {self.group.name} rank {rank} died (exit code {code})"
        if code in LOST_EXIT_CODES:
            return WorkerLost(cause + then, cause)
        silent = self._silent_peers(rank)
        if code == ABORTED and silent:
            cause = (f"{self.what}: {self.group.name} rank {rank} aborted (exit code {code}) "
                     f"after collective_timeout_s while ranks {silent} had not answered: "
                     f"NCCL's watchdog (a peer hung)")
            return WorkerLost(cause + then, cause, hang(self.what))
        return WorkerError(cause + then)

    def _silent_peers(self, rank: int) -> list[int]:
        """The ranks besides `rank` that have not answered (alive, or aborted too), if the
        call has run for collective_timeout_s: long enough for NCCL's watchdog to abort
        `rank` waiting for them in a collective (a collective of a call starts after the call
        does). Before then, or with every peer answered, an abort is the rank's own."""
        if time.monotonic() - self.started < self.group.collective_timeout_s:
            return []
        # A hang of the fabric makes every rank's watchdog abort within a second or so: a
        # peer that aborted without answering was waiting too.
        return [r for r in sorted(self.pending)
                if r != rank and self.group.procs[r].exitcode in (None, ABORTED)]

    def _raise_if_a_rank_died(self, then: str, grace_s: float = 2.0) -> None:
        """A rank that dies makes its peers fail in their next collective, often before its
        own exit is seen here: name the dead rank (the cause), not the first peer to fail.
        Ranks that report a failure exit with code 0 after it; a dead one has another code."""
        deadline = time.monotonic() + grace_s
        while True:
            dead = [(rank, proc.exitcode) for rank, proc in enumerate(self.group.procs)
                    if proc.exitcode not in (None, 0)]
            if dead:  # a rank killed from outside first, then one that crashed on its own:
                # its peers may abort after it (NCCL's watchdog)
                rank, code = min(dead, key=lambda d: (d[1] not in LOST_EXIT_CODES,
                                                      d[1] == ABORTED, d[0]))
                raise self._death(rank, code, then)
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)


class LocalWorkerGroup:
    """`nproc` spawned processes, gloo/NCCL between them. Start-up runs in the background:
    wait for `starting` before the first call. `collective_timeout_s`: the ranks' (see
    LocalCall._death)."""

    def __init__(self, name: str, nproc: int, worker_args: tuple, *, threads: int = 1,
                 collective_timeout_s: float = 600.0):
        self.name, self.nproc = name, nproc
        self.collective_timeout_s = collective_timeout_s
        pipes = [mp.Pipe() for _ in range(nproc)]
        self.conns = [parent for parent, _ in pipes]
        self.procs = spawn_ranks(_serve, [(rank, worker_args, child)
                                          for rank, (_, child) in enumerate(pipes)],
                                 name=f"megarlhf-ppo-{name}", threads=threads,
                                 env={"VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
        self.starting = LocalCall(self, "start-up")

    def async_call(self, method: str, *args) -> LocalCall:
        message = dumps((method, args))  # once for all ranks
        call = LocalCall(self, method)
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(message)
            except (BrokenPipeError, ConnectionError):
                call.raise_closed(rank)
        return call

    def address(self) -> tuple[str, int]:
        """A free port where this group's rank 0 runs (this machine)."""
        return "127.0.0.1", free_port()

    def stop(self) -> None:
        """Ask every rank to stop (engines shut down cleanly); `join` waits for them."""
        for conn, proc in zip(self.conns, self.procs):
            if proc.is_alive():
                try:
                    _send(conn, (None, ()))
                except (BrokenPipeError, OSError):
                    pass

    def join(self, deadline: float) -> None:
        """Wait for the ranks until `deadline` (time.monotonic()), then kill the rest."""
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                _kill_tree(proc)


def _kill_tree(proc: mp.Process) -> None:
    """Kill a rank and the processes it started (dist_checkpointing's file writers, for one),
    which would otherwise outlive it."""
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    proc.kill()
    for child in children:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    proc.join()


class LocalBackend:
    """Makes local worker groups and waits on their calls."""

    def __init__(self, total_ranks: int, *, timeout_s: float = 1800.0,
                 collective_timeout_s: float = 600.0):
        """`collective_timeout_s`: the ranks' (PPOConfig.collective_timeout_s)."""
        self.timeout_s, self.collective_timeout_s = timeout_s, collective_timeout_s
        # Every rank of every group shares this machine's cores, unless the user says.
        self.threads = int(os.environ.get("OMP_NUM_THREADS")
                           or max(1, (os.cpu_count() or 1) // total_ranks))

    def group(self, name: str, nproc: int, worker_args: tuple, *,
              room_wait_s: float | None = None) -> LocalWorkerGroup:
        """`room_wait_s` is the Ray backend's: local ranks never wait for room."""
        return LocalWorkerGroup(name, nproc, worker_args, threads=self.threads,
                                collective_timeout_s=self.collective_timeout_s)

    def wait_all(self, calls: list[LocalCall],
                 timeout_s: float | None = None) -> list[list[tuple]]:
        """Per call and rank, (result (rank 0; None elsewhere), seconds in the method).
        `timeout_s`: the phase's deadline (None: the backend's)."""
        timeout_s = timeout_s or self.timeout_s
        deadline = time.monotonic() + timeout_s
        while any(call.pending for call in calls):
            waitables = [w for call in calls for w in call.waitables()]
            if not mp.connection.wait(waitables, timeout=max(0.0, deadline - time.monotonic())):
                late = ", ".join(sorted(f"{c.group.name} ranks {sorted(c.pending)}"
                                        for c in calls if c.pending))
                raise past_deadline(calls[0].what, late, timeout_s)
            try:
                for call in calls:
                    call.collect()
            except CollectiveFailed as peer:
                raise own_failure(calls, peer) from None
        return [call.results for call in calls]

    def shutdown(self) -> None:
        """Nothing outlives the groups here."""
