"""The worker group on Ray: one actor per rank, placed together by a placement group.

Ray is started locally (`ray.init`) unless a cluster is already running (RAY_ADDRESS, or
`ray start` on a Slurm allocation). The ranks meet through torch.distributed at rank 0's node.
"""

from __future__ import annotations

import os

from megarlhf.ppo.groups import WorkerError


class _Rank:
    """Ray actor body: one PPOWorker."""

    def address(self) -> tuple[str, int]:
        import ray

        from megarlhf.parallel.mesh import free_port

        return ray.util.get_node_ip_address(), free_port()

    def start(self, rank: int, world_size: int, addr: str, port: int, config) -> None:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0",
                          MASTER_ADDR=addr, MASTER_PORT=str(port),
                          VLLM_ENABLE_V1_MULTIPROCESSING="0")
        from megarlhf.ppo.worker import PPOWorker

        self.worker = PPOWorker(config)

    def call(self, method: str, args):
        return getattr(self.worker, method)(*args)

    def stop(self) -> None:
        self.worker.shutdown()


class RayWorkerGroup:
    def __init__(self, config, *, cpus_per_rank: float = 1.0):
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self._ray = ray
        self._started_ray = not ray.is_initialized()
        if self._started_ray:
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False,
                     **({} if os.environ.get("RAY_ADDRESS") else
                        {"num_cpus": max(config.nproc, os.cpu_count() or 1)}))
        self._pg = placement_group([{"CPU": cpus_per_rank}] * config.nproc, strategy="PACK")
        ray.get(self._pg.ready())
        threads = str(max(1, int(cpus_per_rank)))
        actor = ray.remote(_Rank)
        self._ranks = [
            actor.options(
                num_cpus=cpus_per_rank,
                runtime_env={"env_vars": {"OMP_NUM_THREADS": threads}},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self._pg, placement_group_bundle_index=rank),
            ).remote()
            for rank in range(config.nproc)
        ]
        addr, port = ray.get(self._ranks[0].address.remote())
        self._wait("start-up", [r.start.remote(i, config.nproc, addr, port, config)
                                for i, r in enumerate(self._ranks)])

    def call(self, method: str, *args):
        args_ref = self._ray.put(args)  # one copy in the object store for all ranks
        return self._wait(method, [r.call.remote(method, args_ref) for r in self._ranks])[0]

    def _wait(self, what: str, refs: list) -> list:
        ray = self._ray
        rank_of = {ref: i for i, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            try:
                ray.get(done[0])
            except Exception as e:  # noqa: BLE001 - RayTaskError / RayActorError carry the cause
                self.shutdown()
                raise WorkerError(f"{what} failed on rank {rank_of[done[0]]}:\n{e}") from None
        return ray.get(refs)

    def shutdown(self) -> None:
        ray = self._ray
        for rank in self._ranks:
            try:
                ray.get(rank.stop.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - a dead or stuck rank is killed below anyway
                pass
            ray.kill(rank)
        self._ranks = []
        ray.util.remove_placement_group(self._pg)
        if self._started_ray:
            ray.shutdown()
