"""Worker groups on Ray: one actor per rank, a group's actors placed together by a placement
group; the same interface as the local groups (groups.py).

Ray is started locally (`ray.init`) unless a cluster is already running (RAY_ADDRESS, or
`ray start` on a Slurm allocation). A group's ranks meet through torch.distributed at its
rank 0's node.
"""

from __future__ import annotations

import math
import os
import pickle
import time

from megarlhf import logs
from megarlhf.errors import NoRoom, describe
from megarlhf.ppo.groups import (WorkerError, WorkerInputError, WorkerLost, collective_failed,
                                 dumps, past_deadline, peer_failure)

_INLINE_BYTES = 64 * 1024
"""Smaller call arguments travel inside each rank's task (a put costs more than a copy)."""


class _Rank:
    """Ray actor body: one PPOWorker."""

    def address(self) -> tuple[str, int]:
        import ray

        from megarlhf.parallel.mesh import free_port

        return ray.util.get_node_ip_address(), free_port()

    def start(self, rank: int, world_size: int, master: tuple[str, int], worker_args: tuple
              ) -> bytes:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0",
                          MASTER_ADDR=master[0], MASTER_PORT=str(master[1]),
                          VLLM_ENABLE_V1_MULTIPROCESSING="0")
        from megarlhf.ppo.worker import PPOWorker

        start = time.perf_counter()
        self.rank, self.worker = rank, PPOWorker(*worker_args)
        return dumps((None, time.perf_counter() - start))

    def call(self, method: str, args: bytes) -> bytes:
        start = time.perf_counter()
        value = getattr(self.worker, method)(*pickle.loads(args))
        # Every rank computes the same result: only rank 0's travels.
        return dumps((value if self.rank == 0 else None, time.perf_counter() - start))

    def stop(self) -> None:
        self.worker.shutdown()


PEER_GRACE_S = 10.0
"""After a rank fails, how long to look for a rank whose actor died: a killed actor's peers
fail in their next collective (connection reset), often before Ray reports the death."""


def _rank_failure(call: "RayCall", rank: int, e: Exception) -> WorkerError:
    """A rank whose actor died (its process killed, OOM-killed, its node lost) is a lost
    worker (the run restarts from its checkpoint); a RayTaskError carries the rank's
    exception as `cause`: bad input (a corrupt file, a full disk) becomes a one-line
    WorkerInputError, anything else keeps Ray's traceback."""
    import ray

    if isinstance(e, ray.exceptions.RayActorError) and not getattr(e, "actor_init_failed",
                                                                    False):
        lost = f"{call.what}: {call.group.name} rank {rank}'s Ray actor died"
        return WorkerLost(f"{lost}:\n{e}", lost)
    cause = getattr(e, "cause", None)
    how = peer_failure(cause)
    if how:  # a peer hung, stopped or died
        return collective_failed(call.what, call.group.name, rank, str(e), how)
    if isinstance(cause, (ValueError, OSError)) and not isinstance(cause, WorkerError):
        error = WorkerInputError(f"{call.what} on {call.group.name} rank {rank}: "
                                 f"{describe(cause)}")
        error.add_note(str(e))
        return error
    return WorkerError(f"{call.what} failed on {call.group.name} rank {rank}:\n{e}")


class RayCall:
    """One method running on every rank of a group: a Ray reference per rank."""

    def __init__(self, group: "RayWorkerGroup", what: str, refs: list):
        self.group, self.what, self.refs = group, what, refs


class RayWorkerGroup:
    def __init__(self, name: str, nproc: int, worker_args: tuple, *,
                 cpus_per_rank: float = 1.0, gpus_per_rank: int = 0,
                 placement_timeout_s: float | None = None):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray, self.name = ray, name
        self._stopping: list = []
        bundle = {"CPU": cpus_per_rank, **({"GPU": gpus_per_rank} if gpus_per_rank else {})}
        # PACK fills a node's GPUs before the next node's, so consecutive ranks (a TP group)
        # share a node; Ray gives each actor its own CUDA_VISIBLE_DEVICES.
        self._pg = placement_group([bundle] * nproc, strategy="PACK")
        try:
            ray.get(self._pg.ready(), timeout=placement_timeout_s)
        except ray.exceptions.GetTimeoutError:
            ray.util.remove_placement_group(self._pg)
            raise NoRoom(
                f"after a fault the Ray cluster had no room for {name}'s {nproc} ranks "
                f"({bundle} each) for {placement_timeout_s:g} s (restart_wait_s; available: "
                f"{ray.available_resources()}): a lost node? Run the job again once it has "
                f"(launch/ppo.sbatch requeues it): it resumes from its last checkpoint") from None
        threads = str(max(1, int(cpus_per_rank)))
        # A running cluster's workers do not inherit this process's environment: the library
        # log levels (megarlhf/logs.py) travel with the thread count.
        env = {"OMP_NUM_THREADS": threads, **logs.library_env()}
        actor = ray.remote(_Rank)
        self._ranks = [
            actor.options(
                num_cpus=cpus_per_rank, num_gpus=gpus_per_rank,
                runtime_env={"env_vars": env},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=rank),
            ).remote()
            for rank in range(nproc)
        ]
        # Passed as a reference, so no group waits here for its rank 0 to come up: every
        # group's actors boot at once and each rank starts once the address is known.
        master = self._ranks[0].address.remote()
        self.starting = RayCall(self, "start-up", [
            r.start.remote(i, nproc, master, worker_args) for i, r in enumerate(self._ranks)])

    def async_call(self, method: str, *args) -> RayCall:
        payload = dumps(args)  # once for all ranks
        if len(payload) > _INLINE_BYTES:  # one copy in the object store for all ranks
            payload = self._ray.put(payload)
        return RayCall(self, method, [r.call.remote(method, payload) for r in self._ranks])

    def address(self) -> tuple[str, int]:
        """A free port on the node of this group's rank 0."""
        return self._ray.get(self._ranks[0].address.remote())

    def stop(self) -> None:
        """Ask every rank to stop (engines shut down cleanly); `join` waits for them."""
        self._stopping = [r.stop.remote() for r in self._ranks]

    def join(self, deadline: float) -> None:
        """Wait for the ranks until `deadline` (time.monotonic()), then kill them all."""
        ray = self._ray
        if self._stopping:
            ray.wait(self._stopping, num_returns=len(self._stopping),
                     timeout=max(0.0, deadline - time.monotonic()))
        for rank in self._ranks:
            ray.kill(rank)
        self._ranks, self._stopping = [], []
        ray.util.remove_placement_group(self._pg)


class RayBackend:
    """Starts Ray here unless a cluster is running; makes Ray worker groups and waits on
    their calls."""

    def __init__(self, total_ranks: int):
        import ray

        self._ray = ray
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False,
                     logging_level=logs.python_level("ray"),
                     **({} if os.environ.get("RAY_ADDRESS") else
                        {"num_cpus": max(total_ranks, os.cpu_count() or 1)}))

    def group(self, name: str, nproc: int, worker_args: tuple, *,
              room_wait_s: float | None = None) -> RayWorkerGroup:
        """`room_wait_s`: how long the group waits for the cluster to have room for its
        ranks (None: as long as it takes; after a fault, PPOConfig.restart_wait_s)."""
        # One GPU per rank wherever the cluster has GPUs; CPU-only clusters run on gloo.
        gpus = 1 if self._ray.cluster_resources().get("GPU", 0) > 0 else 0
        return RayWorkerGroup(name, nproc, worker_args, gpus_per_rank=gpus,
                              placement_timeout_s=room_wait_s)

    def wait_all(self, calls: list[RayCall],
                 timeout_s: float | None = None) -> list[list[tuple]]:
        """Per call and rank, (result (rank 0; None elsewhere), seconds in the method); a
        failed rank raises within a second, while the others may hang in a collective with
        it. `timeout_s`: the phase's deadline (None: none, for the start-up); past it the
        ranks that did not answer are named (WorkerLost: a hang)."""
        ray = self._ray
        owner = {ref: (call, rank) for call in calls for rank, ref in enumerate(call.refs)}
        answers, pending = {}, list(owner)
        deadline = time.monotonic() + (timeout_s or math.inf)
        while pending:
            if time.monotonic() > deadline:
                late = ", ".join(sorted(f"{owner[ref][0].group.name} rank {owner[ref][1]}"
                                        for ref in pending))
                raise past_deadline(calls[0].what, late, timeout_s)
            done, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
            for ref in done:
                try:
                    answers[ref] = pickle.loads(ray.get(ref))
                except Exception as e:  # noqa: BLE001 - RayTaskError / RayActorError carry it
                    failure = _rank_failure(*owner[ref], e)
                    # A rank that raised (a peer gone, a hang, its own error): the rank whose
                    # actor died, if one did, is the cause (maybe in `done`).
                    if not isinstance(e, ray.exceptions.RayActorError):
                        others = [r for r in owner if r not in answers and r != ref]
                        failure = self._dead_rank(owner, others) or failure
                    raise failure from None
        return [[answers[ref] for ref in call.refs] for call in calls]

    def _dead_rank(self, owner: dict, refs: list) -> WorkerLost | None:
        """A rank among `refs` whose actor died, reported within PEER_GRACE_S."""
        ray = self._ray
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=PEER_GRACE_S)
        for ref in done:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError as e:
                return _rank_failure(*owner[ref], e)
            except Exception:  # noqa: BLE001 - another peer's failed collective
                continue
        return None

    def shutdown(self) -> None:
        if self._started_ray:
            self._ray.shutdown()
