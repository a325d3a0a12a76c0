"""A PPO job's memory per GPU: which models each group of ranks holds (ppo/placement.py), at
which layout, and what they allocate in each phase of the loop.

What is planned is what the trainer builds (ppo/worker.py):
- every role at the recipe's TP x PP, its weights in the recipe's dtype; actor and critic with
  fp32 main grads and the distributed optimizer, ref and reward frozen (weights only);
- the rollout engine in the same dtype: Megatron (its own copy of the actor at the rollout
  group's TP, PP=1) or vLLM (engines of config.rollout_tp ranks), sized by its share of the
  rollout batch;
- the peak of a rank is everything resident (all weights, grads and optimizer states, and the
  rollout engine's weights: the worker neither offloads an idle role nor sleeps the engine)
  plus the largest transient of a phase. Phases never overlap on a rank, and inside a phase
  the roles of a rank run one after the other, so a phase's transient is its largest role's:
  rollout (KV cache), experience (forward passes: logits and one layer's activations), train
  (activations kept for backward, logits). Activations are planned without recomputation, as
  the trainer runs; the with-recomputation figure is reported for comparison.
"""

from __future__ import annotations

import dataclasses
import math

from megarlhf.models.config import ModelConfig
from megarlhf.models.transformer_config import parse_dtype
from megarlhf.parallel.mesh import ParallelConfig
from megarlhf.plan import memory
from megarlhf.plan.params import rank_params
from megarlhf.plan.sources import ModelSource, resolve
from megarlhf.ppo.config import PPOConfig
from megarlhf.ppo.layout import GroupSpec, group_specs
from megarlhf.rollout.megatron_engine import MegatronEngineConfig

GIB = 1024**3
PHASES = ("rollout", "experience", "train")
MODEL_ROLES = {"actor": ("actor", False, True), "ref": ("actor", False, False),
               "critic": ("critic", True, True), "reward": ("reward_model", True, False)}
"""role -> (PPOConfig field with its checkpoint, value head, trained)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cluster:
    nodes: int
    gpus_per_node: int = 8
    gpu_mem_gb: float = 80.0
    """Memory of one GPU in GiB (2^30 bytes), as nvidia-smi reports it."""
    reserve_fraction: float = 0.1
    """Kept free for the CUDA context, NCCL buffers and allocator fragmentation."""

    def __post_init__(self):
        for name in ("nodes", "gpus_per_node"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got "
                                 f"{getattr(self, name)!r}")
        if not 0 < self.gpu_mem_gb < math.inf:
            raise ValueError(f"--gpu-mem-gb must be a finite number > 0 (GiB per GPU), got "
                             f"{self.gpu_mem_gb}")
        if not 0 <= self.reserve_fraction < 1:
            raise ValueError(f"reserve_fraction must be in [0, 1), got {self.reserve_fraction}")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def usable_bytes(self) -> int:
        return int(self.gpu_mem_gb * GIB * (1 - self.reserve_fraction))


@dataclasses.dataclass(frozen=True)
class Term:
    role: str
    what: str
    """weights, grads, optimizer, activations, logits or KV cache."""
    bytes: int
    phase: str | None
    """None: resident for the whole run; else the phase it exists in."""


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """One group of ranks at its most loaded pipeline rank."""

    spec: GroupSpec
    first_gpu: int
    """The group's ranks take GPUs first_gpu .. first_gpu + nproc - 1, node by node."""
    pp_rank: int
    terms: tuple[Term, ...]
    recompute: dict[str, int]
    """Trained role -> its train activations with full recomputation (for comparison)."""

    @property
    def resident(self) -> int:
        return sum(t.bytes for t in self.terms if t.phase is None)

    def transient(self, phase: str) -> int:
        per_role: dict[str, int] = {}
        for t in self.terms:
            if t.phase == phase:
                per_role[t.role] = per_role.get(t.role, 0) + t.bytes
        return max(per_role.values(), default=0)

    @property
    def peak_phase(self) -> str:
        return max(PHASES, key=self.transient)

    @property
    def peak(self) -> int:
        return self.resident + self.transient(self.peak_phase)

    def largest_term(self) -> Term:
        """The biggest single term present at the peak."""
        present = [t for t in self.terms if t.phase in (None, self.peak_phase)]
        return max(present, key=lambda t: t.bytes)


@dataclasses.dataclass(frozen=True)
class Plan:
    config: PPOConfig
    cluster: Cluster
    prompt_len: int
    models: dict[str, ModelSource]
    groups: tuple[GroupPlan, ...]

    @property
    def param_bytes(self) -> int:
        """Bytes per parameter of every role and of the rollout engine."""
        return param_bytes(self.config)

    @property
    def gpus_needed(self) -> int:
        return sum(g.spec.nproc for g in self.groups)

    @property
    def worst(self) -> GroupPlan:
        return max(self.groups, key=lambda g: g.peak)

    @property
    def fits(self) -> bool:
        return self.worst.peak <= self.cluster.usable_bytes


def resolve_models(config: PPOConfig) -> dict[str, ModelSource]:
    """Role -> its model's shape, for the roles this job has."""
    roles = set().union(*(spec.roles for spec in group_specs(config)))
    models = {}
    for role, (field, value_head, _) in MODEL_ROLES.items():
        if role in roles:
            models[role] = resolve(getattr(config, field), field=field, value_head=value_head)
    return models


def check_models(config: PPOConfig, models: dict[str, ModelSource], seq: int) -> list[str]:
    """What makes the models unrunnable at the recipe's layout, each with a fix."""
    problems = []
    for role, source in models.items():
        training = config.parallel_of(role)
        if role == "ref" and "actor" in models and training == config.parallel_of("actor"):
            continue  # the actor's checkpoint at the actor's layout, checked as the actor
        try:
            source.model.check_parallel(training)
        except ValueError as e:
            problems.append(f"{role}: {e}")
        if seq > source.model.max_position_embeddings:
            problems.append(f"{role}: a prompt + response of {seq} tokens exceeds the model's "
                            f"max_position_embeddings={source.model.max_position_embeddings}; "
                            f"lower max_new_tokens or the prompt length")
    try:
        models["actor"].model.check_parallel(ParallelConfig(tensor_parallel=config.rollout_tp))
    except ValueError as e:
        problems.append(f"rollout engines (layout.rollout.tensor_parallel={config.rollout_tp}): "
                        f"{e}")
    return problems


def check_cluster(config: PPOConfig, cluster: Cluster) -> list[str]:
    """What makes the cluster unable to hold the job's groups, each with a fix. Groups take
    consecutive GPUs in group_specs order, node by node."""
    problems = []
    specs = group_specs(config)
    needed = sum(s.nproc for s in specs)
    if needed > cluster.gpus:
        nodes = math.ceil(needed / cluster.gpus_per_node)
        layout = " + ".join(f"{s.name} {s.nproc}" for s in specs)
        problems.append(f"the job needs {needed} GPUs ({layout}) but {cluster.nodes} node(s) x "
                        f"{cluster.gpus_per_node} GPUs = {cluster.gpus}: short by "
                        f"{needed - cluster.gpus} GPUs; use --nodes {nodes} or a smaller nproc")
    first = 0
    for spec in specs:
        tp = spec.parallel.tensor_parallel
        if cluster.gpus_per_node % tp:
            problems.append(f"{spec.name}: tensor_parallel={tp} groups would span nodes of "
                            f"{cluster.gpus_per_node} GPUs (TP all-reduces inside every layer); "
                            f"keep TP a divisor of gpus_per_node")
        elif first % tp:
            problems.append(f"{spec.name}: starts at GPU {first}, not a multiple of its "
                            f"tensor_parallel={tp}, so a TP group would span nodes; make the "
                            f"groups before it a multiple of {tp} GPUs")
        first += spec.nproc
    # Disaggregated, the rollout group's own TP is its engines' (checked above).
    if config.placement == "colocated" and cluster.gpus_per_node % config.rollout_tp:
        problems.append(f"layout.rollout.tensor_parallel={config.rollout_tp}: engines would span "
                        f"nodes of {cluster.gpus_per_node} GPUs; keep it a divisor of "
                        f"gpus_per_node")
    return problems


def check(config: PPOConfig, cluster: Cluster, models: dict[str, ModelSource], seq: int
          ) -> None:
    """Raise ValueError listing every reason the job cannot run on `cluster` at all."""
    problems = check_models(config, models, seq) + check_cluster(config, cluster)
    if problems:
        raise ValueError("the layout cannot run:\n  " + "\n  ".join(problems))


def param_bytes(config: PPOConfig) -> int:
    return parse_dtype(config.dtype).itemsize


def plan(config: PPOConfig, cluster: Cluster, prompt_len: int,
         models: dict[str, ModelSource] | None = None) -> Plan:
    """The per-GPU memory of every group; ValueError if the layout itself is impossible."""
    models = models if models is not None else resolve_models(config)
    seq = prompt_len + config.max_new_tokens
    check(config, cluster, models, seq)
    groups, first = [], 0
    for spec in group_specs(config):
        per_rank = [_group_at(config, spec, models, seq, first, r)
                    for r in range(spec.parallel.pipeline_parallel)]
        groups.append(max(per_rank, key=lambda g: g.peak))
        first += spec.nproc
    return Plan(config, cluster, prompt_len, models, tuple(groups))


def _group_at(config: PPOConfig, spec: GroupSpec, models: dict[str, ModelSource], seq: int,
              first_gpu: int, pp_rank: int) -> GroupPlan:
    parallel, nbytes = spec.parallel, param_bytes(config)
    tp, pp = parallel.tensor_parallel, parallel.pipeline_parallel
    dp = parallel.data_parallel_size(spec.nproc)
    last = pp_rank == pp - 1
    train_rows = config.rows_per_step // (config.mini_batches * dp * config.micro_batches)
    exp_rows = config.rows_per_step // (dp * config.micro_batches)
    terms, recompute = [], {}
    for role in MODEL_ROLES:
        if role not in spec.roles:
            continue
        model, trained = models[role].model, MODEL_ROLES[role][2]
        lm = not models[role].value_head
        n = rank_params(model, parallel, pp_rank, value_head=not lm)
        terms += [Term(role, what, b, None)
                  for what, b in memory.model_state(n, nbytes, trained=trained, dp=dp).items()]
        terms.append(Term(role, "activations", memory.layer_activations(
            model, parallel, exp_rows, seq, nbytes), "experience"))
        if lm and last:
            terms.append(Term(role, "logits", memory.lm_logits(model, tp, exp_rows, seq, nbytes),
                              "experience"))
        if trained:
            kept = {flag: memory.train_activations(
                model, parallel, pp_rank, rows=train_rows, seq=seq,
                microbatches=config.micro_batches, param_bytes=nbytes, recompute=flag)
                for flag in (False, True)}
            terms.append(Term(role, "activations", kept[False], "train"))
            recompute[role] = kept[True]
            if lm and last:
                terms.append(Term(role, "logits",
                                  memory.lm_logits(model, tp, train_rows, seq, nbytes), "train"))
    if "rollout" in spec.roles:
        terms += _rollout_terms(config, spec, models["actor"].model, seq)
    return GroupPlan(spec, first_gpu, pp_rank, tuple(terms), recompute)


def _rollout_terms(config: PPOConfig, spec: GroupSpec, model: ModelConfig, seq: int
                   ) -> list[Term]:
    """The engine's weights, and the KV cache of its share of the rollout batch at once."""
    n, nbytes = config.samples_per_prompt, param_bytes(config)
    if config.rollout_backend == "megatron":
        # One engine per DP replica, at the group's TP; it generates max_batch_size rows at a
        # time (a prompt's samples together).
        tp = spec.parallel.tensor_parallel
        engines = spec.parallel.data_parallel_size(spec.nproc)
        per_batch = max(1, MegatronEngineConfig().max_batch_size // n)
        rows = min(math.ceil(config.prompts_per_step / engines), per_batch) * n
        kv = memory.kv_cache(model, tp, rows, seq, nbytes)
    else:
        # vLLM pages its cache; the engines get their whole share of the batch at once, so
        # every sequence runs concurrently (rollout/sizing.py, which the workers use too).
        tp = config.rollout_tp
        size = config.vllm_engine_size(model, seq - config.max_new_tokens)
        rows = math.ceil(config.prompts_per_step / config.rollout_engines) * n
        kv = size.kv_cache_bytes if size.kv_cache_bytes is not None else \
            memory.kv_cache(model, tp, rows, size.max_model_len, nbytes)
    weights = rank_params(model, ParallelConfig(tensor_parallel=tp), 0) * nbytes
    return [Term("rollout", "weights", weights, None),
            Term("rollout", "KV cache", kv, "rollout")]
