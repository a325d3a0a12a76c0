"""The device mesh: who we are (rendezvous), how ranks are split (TP, CP, PP, DP), and the
groups.

A `Mesh` is a frozen object holding this rank's coordinates and process groups. Code that needs a
group receives it from the mesh explicitly instead of reading global state. megatron-core's own
schedules and layers still read `megatron.core.parallel_state`, so `init_mesh` initialises that
too and the mesh holds the very same group objects.

Rank order follows megatron-core's default "tp-cp-ep-dp-pp": TP ranks are adjacent (same node),
then CP, then DP, then PP. CP ranks hold the same weights and split every sequence
(models/context_parallel.py); gradients are summed over DP x CP.

Expert parallelism (mixture-of-experts models) is no extra world dimension: the TP x CP x DP
ranks of a pipeline stage are regrouped as expert-TP x EP x expert-DP for the experts' MLPs
(each EP rank holds num_experts / EP experts, split over expert-TP ranks); everything else
(attention, router, norms, embeddings) keeps the TP x CP x DP grouping.
"""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import random
import socket

import torch
import torch.distributed as dist

from megarlhf.compat.megatron import apply_cpu_compat, bind_missing_te_names
from megarlhf.parallel import device as device_lib


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    tensor_parallel: int = 1
    """TP size: ranks that split every weight matrix of a layer (keep within a node)."""
    pipeline_parallel: int = 1
    """PP size: number of pipeline stages the layers are split into."""
    virtual_pipeline_parallel: int | None = None
    """Model chunks per pipeline rank for the interleaved 1F1B schedule (None: plain 1F1B)."""
    sequence_parallel: bool = False
    """Shard activations along the sequence inside TP regions (needs tensor_parallel > 1)."""
    context_parallel: int = 1
    """CP size: ranks that split every sequence (each holds 2 of 2 x CP chunks) and hold the
    same weights."""
    expert_parallel: int = 1
    """EP size (mixture-of-experts models): ranks that split each layer's experts; EP x
    expert_tensor_parallel must divide TP x CP x DP."""
    expert_tensor_parallel: int | None = None
    """Ranks that split each expert's matrices; None: 1 with EP > 1 (experts are narrow, and
    whole experts per rank need no all-reduce inside the expert MLP), TP at EP 1 (see
    `expert_tp`)."""

    def __post_init__(self):
        for name in ("tensor_parallel", "pipeline_parallel", "context_parallel",
                     "expert_parallel", "expert_tp"):
            value = getattr(self, name)
            name = "expert_tensor_parallel" if name == "expert_tp" else name
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        vpp = self.virtual_pipeline_parallel
        if vpp is not None:
            if not isinstance(vpp, int) or vpp < 1:
                raise ValueError(f"virtual_pipeline_parallel must be None or >= 1, got {vpp!r}")
            if vpp > 1 and self.pipeline_parallel < 2:
                raise ValueError(
                    f"virtual_pipeline_parallel={vpp} needs pipeline_parallel >= 2, got "
                    f"{self.pipeline_parallel}; set virtual_pipeline_parallel=None"
                )
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise ValueError("sequence_parallel=True needs tensor_parallel > 1")
        if self.expert_parallel == 1 and self.expert_tp != self.tensor_parallel:
            raise ValueError(
                f"expert_tensor_parallel={self.expert_tensor_parallel} at expert_parallel=1: "
                f"without EP the experts are split like any MLP, over the tensor_parallel="
                f"{self.tensor_parallel} ranks (megatron-core reduces their gradients as "
                f"dense weights then); leave expert_tensor_parallel unset or set expert_parallel")

    @property
    def replica_size(self) -> int:
        """Ranks that together run one data-parallel replica: TP x PP x CP."""
        return self.tensor_parallel * self.pipeline_parallel * self.context_parallel

    @property
    def sequence_multiple(self) -> int:
        """What a micro-batch's sequence length must be a multiple of: 2 x CP (each CP rank
        takes two equal chunks) times TP under sequence parallelism (megatron-core splits each
        rank's part of the sequence over the TP ranks)."""
        cp = 2 * self.context_parallel if self.context_parallel > 1 else 1
        return cp * (self.tensor_parallel if self.sequence_parallel else 1)

    @property
    def num_chunks(self) -> int:
        """Model chunks held by each pipeline rank."""
        return self.virtual_pipeline_parallel or 1

    def with_overrides(self, override: "LayoutOverride") -> "ParallelConfig":
        """This layout with the fields `override` sets replaced (an override may carry fields
        that are not the mesh's, such as a PPO role's recompute: they are not applied here)."""
        mine = {f.name for f in dataclasses.fields(self)}
        return dataclasses.replace(self, **{k: v for k, v in dataclasses.asdict(override).items()
                                            if v is not None and k in mine})

    def without_experts(self) -> "ParallelConfig":
        """This layout for a dense model: expert parallelism regroups ranks only for experts,
        so a dense model sharing ranks with an MoE one runs as if it were 1."""
        return dataclasses.replace(self, expert_parallel=1, expert_tensor_parallel=None)

    def same_mesh(self, other: "ParallelConfig") -> bool:
        """Whether two layouts make the same megatron-core parallel state (sequence
        parallelism is a flag of each model; expert-TP compared as resolved)."""
        def key(p: ParallelConfig) -> ParallelConfig:
            return dataclasses.replace(p, sequence_parallel=False,
                                       expert_tensor_parallel=p.expert_tp)
        return key(self) == key(other)

    def describe(self, dp: int | None = None) -> str:
        """'TP2 x PP4' with the CP, EP (and expert-TP) and DP sizes where they apply."""
        parts = [f"TP{self.tensor_parallel}", f"PP{self.pipeline_parallel}"]
        if self.context_parallel > 1:
            parts.append(f"CP{self.context_parallel}")
        if self.expert_parallel > 1:
            parts.append(f"EP{self.expert_parallel}")
        if self.expert_parallel > 1:
            parts.append(f"ETP{self.expert_tp}")
        if dp is not None:
            parts.append(f"DP{dp}")
        return " x ".join(parts)

    @property
    def expert_tp(self) -> int:
        """expert_tensor_parallel, resolved. At EP 1 it is TP: megatron-core then treats the
        experts as dense weights and reduces their gradients over DP only, so experts split
        otherwise than over the TP ranks would keep partial gradients (measured: at TP2 + SP
        with whole experts per rank, each rank's expert gradient held only its tokens')."""
        if self.expert_tensor_parallel is not None:
            return self.expert_tensor_parallel
        return self.tensor_parallel if self.expert_parallel == 1 else 1

    @property
    def expert_group_size(self) -> int:
        """expert_parallel x expert_tensor_parallel: must divide each stage's TP x CP x DP."""
        return self.expert_parallel * self.expert_tp

    @property
    def min_data_parallel(self) -> int:
        """The fewest DP replicas whose TP x CP x DP ranks the expert groups divide (1 for a
        dense layout)."""
        stage = self.tensor_parallel * self.context_parallel
        return math.lcm(stage, self.expert_group_size) // stage

    def data_parallel_size(self, world_size: int) -> int:
        if world_size % self.replica_size:
            raise ValueError(
                f"world size {world_size} is not divisible by tensor_parallel x pipeline_parallel "
                f"x context_parallel = {self.tensor_parallel} x {self.pipeline_parallel} x "
                f"{self.context_parallel} = {self.replica_size}; use a world size that "
                f"is a multiple of {self.replica_size}"
            )
        dp = world_size // self.replica_size
        stage = self.tensor_parallel * self.context_parallel * dp
        if stage % self.expert_group_size:
            raise ValueError(
                f"expert_parallel x expert_tensor_parallel = {self.expert_parallel} x "
                f"{self.expert_tp} does not divide the {stage} ranks of a pipeline "
                f"stage (tensor_parallel x context_parallel x data_parallel = "
                f"{self.tensor_parallel} x {self.context_parallel} x {dp}); use more ranks or "
                f"a smaller expert_parallel")
        return dp


@dataclasses.dataclass(frozen=True)
class LayoutOverride:
    """The layout fields one part of a job sets for itself (a PPO role, in the config's
    `layout` section); a field left None keeps the job's default."""

    tensor_parallel: int | None = None
    """Tensor-parallel ranks (None: the job's)."""
    pipeline_parallel: int | None = None
    """Pipeline stages (None: the job's)."""
    sequence_parallel: bool | None = None
    """Sequence parallelism within the tensor-parallel group (None: the job's)."""
    context_parallel: int | None = None
    """Ranks splitting each sequence (None: the job's)."""
    expert_parallel: int | None = None
    """Ranks splitting a mixture-of-experts layer's experts (None: the job's)."""
    expert_tensor_parallel: int | None = None
    """Tensor-parallel ranks within an expert (None: the job's)."""

    @property
    def is_set(self) -> bool:
        return any(v is not None for v in dataclasses.asdict(self).values())



@dataclasses.dataclass(frozen=True, kw_only=True)
class DistEnv:
    """Where this process sits among all processes of the job, and how to meet the others."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int

    @classmethod
    def detect(cls) -> "DistEnv":
        """Read the rendezvous from torchrun variables, else from Slurm, else a single rank."""
        env = os.environ
        if not started_by_launcher(env):
            return cls(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1",
                       master_port=free_port())
        if "RANK" in env and "WORLD_SIZE" in env:
            return cls(
                rank=int(env["RANK"]),
                world_size=int(env["WORLD_SIZE"]),
                local_rank=int(env.get("LOCAL_RANK", 0)),
                master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
                master_port=int(env.get("MASTER_PORT", 29500)),
            )
        return cls.from_slurm(env)

    @classmethod
    def from_slurm(cls, env) -> "DistEnv":
        master = env.get("MASTER_ADDR")
        if not master:
            nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
            if not nodelist:
                raise ValueError("running under Slurm but SLURM_JOB_NODELIST is not set; set "
                                 "MASTER_ADDR to the host of rank 0")
            master = first_host(nodelist)
        job_id = int(env.get("SLURM_JOB_ID", "0"))
        return cls(
            rank=int(env["SLURM_PROCID"]),
            world_size=int(env.get("SLURM_STEP_NUM_TASKS") or env["SLURM_NTASKS"]),
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            master_addr=master,
            # One port per job, so two jobs sharing a node do not collide; below the
            # ephemeral range, where no outgoing socket takes it first.
            master_port=int(env.get("MASTER_PORT") or SLURM_BASE_PORT + job_id % 20000),
        )


def started_by_launcher(env=None) -> bool:
    """Whether torchrun or an srun step started this process as one rank of a job. A Slurm
    batch script itself also has SLURM_PROCID=0 and the job's SLURM_NTASKS but is no rank (no
    step): a command run there directly is a single process."""
    env = os.environ if env is None else env
    return ("RANK" in env and "WORLD_SIZE" in env) or ("SLURM_STEP_ID" in env
                                                       and "SLURM_PROCID" in env)


def first_host(nodelist: str) -> str:
    """First host of a Slurm compressed node list: the first entry of each bracket of the first
    comma-separated name, e.g. 'gpu[003-010,012],login1' -> 'gpu003',
    'rack[1-2]-n[01-04]' -> 'rack1-n01'."""
    bad = ValueError(f"cannot parse Slurm node list {nodelist!r}; set MASTER_ADDR to the host "
                     f"of rank 0")
    text, host, i = nodelist.strip(), [], 0
    while i < len(text) and text[i] != ",":
        if text[i] == "[":
            end = text.find("]", i)
            first = text[i + 1:end].split(",")[0].split("-")[0] if end > 0 else ""
            if not first:
                raise bad
            host.append(first)
            i = end + 1
        else:
            host.append(text[i])
            i += 1
    if not host or "]" in "".join(host):
        raise bad
    return "".join(host)


_HANDED_OUT: set[int] = set()

# Rendezvous ports come from below the system's ephemeral range (Linux: 32768-60999), where the
# kernel never hands a port to a socket bound to port 0. A port the system offered from inside
# that range could be taken, between choosing it and a rank binding it seconds later, by any
# other process's outgoing or gloo socket (seen in CI: EADDRINUSE when a group's rank 0 starts).
_PORTS_BELOW_EPHEMERAL = 16384
SLURM_BASE_PORT = 12000  # a job's default port is SLURM_BASE_PORT + job id % 20000


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port nothing listens on now, outside the ephemeral range, that this process has not
    handed out before (two launches in a row, a PPO job's groups, each get their own)."""
    high = _ephemeral_low()
    low = max(1024, high - _PORTS_BELOW_EPHEMERAL)
    for _ in range(1000):
        port = random.randrange(low, high) if high > low else 0
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            port = s.getsockname()[1]
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError(f"no free port in {low}-{high - 1}; set MASTER_PORT")


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class Mesh:
    """This rank's place in the TP x CP x PP x DP mesh, with the groups that connect it."""

    config: ParallelConfig
    rank: int
    world_size: int
    device: torch.device
    backend: str
    tp_rank: int
    pp_rank: int
    dp_rank: int
    dp_size: int
    cp_rank: int
    cp_group: dist.ProcessGroup
    """Ranks splitting the same sequences (one rank when context_parallel is 1)."""
    ep_rank: int
    ep_group: dist.ProcessGroup
    """Ranks holding different experts of the same layers (one rank when expert_parallel is
    1 or the model is dense)."""
    expert_tp_group: dist.ProcessGroup
    """Ranks splitting the same experts' matrices (expert tensor parallel)."""
    tp_group: dist.ProcessGroup
    pp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    """Ranks holding the same model shard and different rows (without the CP ranks: those
    hold the same rows)."""
    model_parallel_group: dist.ProcessGroup
    """TP x PP ranks that together hold one full model replica."""
    embedding_group: dist.ProcessGroup | None
    """First and last pipeline stage (tied embeddings), None when this rank is in neither."""

    @property
    def tp(self) -> int:
        return self.config.tensor_parallel

    @property
    def pp(self) -> int:
        return self.config.pipeline_parallel

    @property
    def cp(self) -> int:
        return self.config.context_parallel

    @property
    def ep(self) -> int:
        return self.config.expert_parallel

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    @property
    def last_stage_rank(self) -> int:
        """Global rank of the last pipeline stage holding this rank's TP/DP coordinates."""
        return dist.get_global_rank(self.pp_group, self.pp - 1)


def init_distributed(env: DistEnv | None = None, *, timeout_s: float = 600.0) -> DistEnv:
    """Start torch.distributed (NCCL on GPU, gloo on CPU) unless it is already running."""
    env = env or DistEnv.detect()
    apply_cpu_compat()
    bind_missing_te_names()
    if device_lib.accelerator_available():
        torch.cuda.set_device(env.local_rank % torch.cuda.device_count())
    # Read by each NCCL process group made from here on. 3 (SkipCleanUp, torch 2.13's
    # default, which has changed before): a collective past `timeout_s`, or one that lost its
    # peer, makes the watchdog abort the rank (SIGABRT), which the PPO controller takes for
    # a hung peer (ppo/groups.py, LocalCall._death; under Ray, an actor's death). 0 would
    # leave the rank waiting forever, 2 leaves the error to the rank's next wait, and 1
    # first aborts the communicators, which can itself hang with a peer gone.
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "3"
    if not dist.is_initialized():
        dist.init_process_group(
            backend=device_lib.default_backend(),
            init_method=f"tcp://{env.master_addr}:{env.master_port}",
            rank=env.rank,
            world_size=env.world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    return env


def init_mesh(config: ParallelConfig, env: DistEnv | None = None, *, seed: int = 0,
              timeout_s: float = 600.0) -> Mesh:
    """Join (or start) the process group, split it into TP/CP/PP/DP groups, and seed the RNGs.
    `timeout_s`: how long a collective of any of them waits for a missing peer.

    Every rank's default generator gets `seed` (so CPU-initialised weights are identical in
    every layout); megatron-core's tracker gets per-TP-rank streams for dropout in TP regions.
    """
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    if dist.is_initialized():
        world_size = dist.get_world_size()
    else:
        env = env or DistEnv.detect()
        world_size = env.world_size
    dp_size = config.data_parallel_size(world_size)  # validates before any process group exists
    init_distributed(env, timeout_s=timeout_s)

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=config.tensor_parallel,
        pipeline_model_parallel_size=config.pipeline_parallel,
        context_parallel_size=config.context_parallel,
        expert_model_parallel_size=config.expert_parallel,
        expert_tensor_parallel_size=config.expert_tp,
        virtual_pipeline_model_parallel_size=config.virtual_pipeline_parallel,
        distributed_timeout_minutes=timeout_s / 60,
    )
    torch.manual_seed(seed)
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    embedding_group = ps.get_embedding_group(check_initialized=False)
    return Mesh(
        config=config,
        rank=dist.get_rank(),
        world_size=world_size,
        device=device_lib.default_device(),
        backend=dist.get_backend(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
        dp_size=dp_size,
        cp_rank=ps.get_context_parallel_rank(),
        cp_group=ps.get_context_parallel_group(),
        ep_rank=ps.get_expert_model_parallel_rank(),
        ep_group=ps.get_expert_model_parallel_group(),
        expert_tp_group=ps.get_expert_tensor_parallel_group(),
        tp_group=ps.get_tensor_model_parallel_group(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(),
        model_parallel_group=ps.get_model_parallel_group(),
        embedding_group=embedding_group if ps.is_rank_in_embedding_group() else None,
    )


def destroy_mesh() -> None:
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
