"""A one-process stand-in for a rank of a parallel world: megatron-core's process groups on
torch's fake backend, which answers every collective without communicating. Models can be
built (the memory planner's tests) and, in a world of one, run (tests/test_packed.py)."""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from megarlhf.parallel.mesh import Mesh, ParallelConfig


@contextlib.contextmanager
def fake_rank(parallel: ParallelConfig, rank: int):
    """This process as global rank `rank` of a TP x PP world (x the DP replicas its expert
    groups need) that does no communication."""
    from megatron.core import parallel_state as ps
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megarlhf.compat.megatron import apply_cpu_compat

    apply_cpu_compat()
    world = parallel.replica_size * parallel.min_data_parallel
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        # gloo side-groups cannot be made on the fake backend, and building needs none.
        ps.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tensor_parallel,
            pipeline_model_parallel_size=parallel.pipeline_parallel,
            virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_parallel,
            expert_model_parallel_size=parallel.expert_parallel,
            expert_tensor_parallel_size=parallel.expert_tp,
            create_gloo_process_groups=False)
        yield Mesh(config=parallel, rank=rank, world_size=world, device=torch.device("cpu"),
                   backend="fake", tp_rank=ps.get_tensor_model_parallel_rank(),
                   pp_rank=ps.get_pipeline_model_parallel_rank(), dp_rank=0, dp_size=1,
                   cp_rank=0, cp_group=ps.get_context_parallel_group(), ep_rank=0,
                   ep_group=ps.get_expert_model_parallel_group(),
                   expert_tp_group=ps.get_expert_tensor_parallel_group(),
                   tp_group=ps.get_tensor_model_parallel_group(),
                   pp_group=ps.get_pipeline_model_parallel_group(),
                   dp_group=ps.get_data_parallel_group(),
                   model_parallel_group=ps.get_model_parallel_group(), embedding_group=None)
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


