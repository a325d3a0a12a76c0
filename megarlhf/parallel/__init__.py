"""Process groups, rendezvous, device selection, local launcher, vocab-parallel ops."""

from megarlhf.parallel.device import default_device
from megarlhf.parallel.launcher import RankError, launch_local
from megarlhf.parallel.mesh import DistEnv, Mesh, ParallelConfig, destroy_mesh, init_mesh

__all__ = [
    "default_device", "RankError", "launch_local", "DistEnv", "Mesh",
    "ParallelConfig", "destroy_mesh", "init_mesh",
]
