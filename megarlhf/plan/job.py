"""A PPO job's memory per GPU: which models each group of ranks holds (ppo/layout.py), at
which layout, and what is on the device in each phase of the loop.

What is planned is what the trainer builds (ppo/worker.py):
- every role at its layout (PPOConfig.parallel_of: TP x PP, and sequence parallelism for its
  activations), its weights in the recipe's dtype; actor and critic with fp32 main grads and
  the distributed optimizer, and their activation recomputation (PPOConfig.recompute_of);
  ref and reward frozen (weights only);
- the rollout engine in the same dtype: Megatron (its own copy of the actor at the rollout
  group's TP, PP=1; KV cache allocated inside generate) or vLLM (engines of
  config.rollout_tp ranks, KV cache allocated at start), sized by its share of the batch.

A step runs four phases, one after the other on a rank: rollout (the engines generate),
experience (the roles' forward passes, one role after another; the reward model's scoring
of the rollouts is one), train (actor and critic alternate per mini-batch) and sync (the
actor's weights streamed into the engines); a fifth, checkpoint, saves (or loads) the actor
and critic after a step's sync. Each term is on the device in some phases, held for the whole
phase or only while its role runs (Term.held, Term.running). Colocated, the switches move
terms off the device (ppo/residency.py, the worker):

                      rollout   experience     train       sync        checkpoint
  model weights       held      held           held        held        held
   offload_params     -         while running  actor,      actor       actor, critic
                                               critic
  grads (actor,       held      held           held        held        held
   critic)
   offload_grads      -         -              held        -           -
  optimizer states    held      held           held        held        held
   offload_optimizer  -         -              held        -           held
  engine weights      held      held           held        held        held
   rollout_sleep      held      -              -           held        held
                                                           (woken)
  engine KV cache     vLLM: held in every phase; with rollout_sleep in rollout and
                      checkpoint (woken after the sync's weights). Megatron: while
                      generating only.
  transients          KV cache, a forward:     one role's  the bridge's (none
                      genera-   a layer or     kept acti-  buffers      planned)
                      tion      its logits     vations and
                                               backward

So a phase's peak is what is held plus its largest role's running terms: with offload_params
only one role's weights are on the device at a time during experience (loaded before its
forward, offloaded before the next role's). Offloaded weights and optimizer states live in
pinned host memory (grads are dropped, not copied): per node, the sum over its ranks
(Plan.host_per_node), checked against Cluster.host_mem_gb. A disaggregated group holds only
the roles it runs, and the switches are refused there (PPOConfig).
"""

from __future__ import annotations

import dataclasses
import math

from megarlhf.models.config import ModelConfig
from megarlhf.models.transformer_config import parse_dtype
from megarlhf.parallel.mesh import ParallelConfig
from megarlhf.plan import memory
from megarlhf.plan.params import (rank_adapter_params, rank_expert_params, rank_params,
                                   total_params)
from megarlhf.ppo import residency as phase_needs
from megarlhf.ppo.config import PPOConfig
from megarlhf.ppo.layout import GroupSpec, group_specs
from megarlhf.ppo.preflight import fit_limit
from megarlhf.rewards.judge import judge_limit
from megarlhf.ppo.sources import (MODEL_ROLES, ModelSource, check_models, resolve,
                                  resolve_models, role_of)
from megarlhf.rollout.bridge import DEFAULT_BUCKET_BYTES
from megarlhf.rollout.megatron_engine import MegatronEngineConfig

GIB = 1024**3
PHASES = ("rollout", "experience", "train", "sync", "checkpoint")
EVERY = frozenset(PHASES)
SWITCHES = ("offload_params", "offload_grads", "offload_optimizer", "rollout_sleep")
"""PPOConfig's switches that move terms off the device between phases (colocated only)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Cluster:
    nodes: int
    gpus_per_node: int = 8
    gpu_mem_gb: float = 80.0
    """Memory of one GPU in GiB (2^30 bytes), as nvidia-smi reports it."""
    reserve_fraction: float = 0.1
    """Kept free for the CUDA context, NCCL buffers and allocator fragmentation."""
    host_mem_gb: float = 2048.0
    """Host (CPU) memory of one node in GiB: 2 TiB, as an 8 x 80 GB node (DGX A100 / H100)
    has. Offloaded weights and optimizer states are pinned there."""
    host_reserve_fraction: float = 0.25
    """Of host memory, kept for the OS, the ranks' own processes and the Ray object store:
    pinned memory cannot be swapped out."""

    def __post_init__(self):
        for name in ("nodes", "gpus_per_node"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got "
                                 f"{getattr(self, name)!r}")
        for name, flag in (("gpu_mem_gb", "--gpu-mem-gb"), ("host_mem_gb", "--host-mem-gb")):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{flag} must be a finite number > 0 (GiB per "
                                 f"{'GPU' if name == 'gpu_mem_gb' else 'node'}), got "
                                 f"{getattr(self, name)}")
        for name in ("reserve_fraction", "host_reserve_fraction"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def usable_bytes(self) -> int:
        return int(self.gpu_mem_gb * GIB * (1 - self.reserve_fraction))

    @property
    def usable_host_bytes(self) -> int:
        return int(self.host_mem_gb * GIB * (1 - self.host_reserve_fraction))


@dataclasses.dataclass(frozen=True)
class Term:
    role: str
    what: str
    """weights, grads, optimizer, forward pass, activations (kept for backward), backward
    (what a backward adds at its peak), KV cache, generation, scoring (a vLLM teacher's
    logits) or sync buffers."""
    bytes: int
    held: frozenset[str] = frozenset()
    """Phases it is on the device for the whole phase."""
    running: frozenset[str] = frozenset()
    """Phases it is on the device only while its role runs (roles of a phase run one after
    the other)."""
    pinned: bool = False
    """Kept in pinned host memory while off the device (offloaded weights, optimizer
    states)."""

    def on_device(self, phase: str) -> bool:
        return phase in self.held or phase in self.running


@dataclasses.dataclass(frozen=True)
class Stage:
    """One rank of a group at pipeline stage `pp_rank` (every TP and DP rank of a stage holds
    the same)."""

    pp_rank: int
    terms: tuple[Term, ...]

    def held(self, phase: str) -> int:
        return sum(t.bytes for t in self.terms if phase in t.held)

    def running(self, phase: str) -> dict[str, int]:
        """Role -> the bytes on the device only while it runs in `phase`."""
        per_role: dict[str, int] = {}
        for t in self.terms:
            if phase in t.running:
                per_role[t.role] = per_role.get(t.role, 0) + t.bytes
        return per_role

    def transient(self, phase: str) -> int:
        return max(self.running(phase).values(), default=0)

    def phase_peak(self, phase: str) -> int:
        return self.held(phase) + self.transient(phase)

    @property
    def peak_phase(self) -> str:
        return max(PHASES, key=self.phase_peak)

    @property
    def peak(self) -> int:
        return self.phase_peak(self.peak_phase)

    @property
    def pinned_bytes(self) -> int:
        """Pinned host memory of this rank: the bytes it offloads."""
        return sum(t.bytes for t in self.terms if t.pinned)

    def present(self, phase: str) -> list[Term]:
        """The terms on the device at `phase`'s peak: the held ones and the running terms of
        the role with the most."""
        running = self.running(phase)
        top = max(running, key=running.get) if running else None
        return [t for t in self.terms if phase in t.held
                or (phase in t.running and t.role == top)]

    def largest_term(self) -> Term:
        """The biggest single term present at the peak."""
        return max(self.present(self.peak_phase), key=lambda t: t.bytes)


@dataclasses.dataclass(frozen=True)
class GroupPlan:
    """One group of ranks: every pipeline stage's plan; the report shows the most loaded."""

    spec: GroupSpec
    first_gpu: int
    """The group's ranks take GPUs first_gpu .. first_gpu + nproc - 1, node by node."""
    stages: tuple[Stage, ...]

    @property
    def most_loaded(self) -> Stage:
        return max(self.stages, key=lambda s: s.peak)

    @property
    def pp_rank(self) -> int:
        return self.most_loaded.pp_rank

    @property
    def terms(self) -> tuple[Term, ...]:
        """The most loaded stage's terms."""
        return self.most_loaded.terms

    def phase_peak(self, phase: str) -> int:
        """`phase`'s peak over the group's stages (each phase may peak on another stage)."""
        return max(s.phase_peak(phase) for s in self.stages)

    @property
    def peak_phase(self) -> str:
        return self.most_loaded.peak_phase

    @property
    def peak(self) -> int:
        return self.most_loaded.peak

    def largest_term(self) -> Term:
        return self.most_loaded.largest_term()

    def rank_pinned_bytes(self, rank: int) -> int:
        """Pinned host bytes of the group's `rank`. Megatron's rank order is tp-cp-ep-dp-pp:
        pipeline stage r holds ranks r x TP x DP .. (r + 1) x TP x DP - 1."""
        return self.stages[rank // (self.spec.nproc // len(self.stages))].pinned_bytes


@dataclasses.dataclass(frozen=True)
class Plan:
    config: PPOConfig
    cluster: Cluster
    prompt_len: int
    models: dict[str, ModelSource]
    groups: tuple[GroupPlan, ...]
    host_per_node: tuple[int, ...]
    """Host bytes of each node (the sum over its ranks): pinned offloads, and with
    sync_mode=delta the buckets kept for it (delta_copy_bytes)."""

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
    def host_node(self) -> int:
        """The node with the most pinned host memory."""
        return max(range(len(self.host_per_node)), key=self.host_per_node.__getitem__)

    @property
    def host_peak(self) -> int:
        return max(self.host_per_node, default=0)

    @property
    def fits_gpu(self) -> bool:
        return self.worst.peak <= self.cluster.usable_bytes

    @property
    def fits_host(self) -> bool:
        return self.host_peak <= self.cluster.usable_host_bytes

    @property
    def fits(self) -> bool:
        return self.fits_gpu and self.fits_host


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
    """The per-GPU memory of every group and the pinned host memory of every node;
    ValueError if the layout itself is impossible."""
    models = models if models is not None else resolve_models(config)
    seq = prompt_len + config.max_new_tokens
    check(config, cluster, models, seq)
    judge = config.reward_judge and resolve(config.reward_judge.model,
                                            field="reward_judge.model", value_head=False,
                                            lora=True)
    groups, first = [], 0
    host = [0] * cluster.nodes
    for spec in group_specs(config):
        group = GroupPlan(spec, first, tuple(_stage(config, spec, models, prompt_len, r, judge)
                                             for r in range(spec.parallel.pipeline_parallel)))
        groups.append(group)
        for rank in range(spec.nproc):
            host[(first + rank) // cluster.gpus_per_node] += group.rank_pinned_bytes(rank) \
                + delta_copy_bytes(config, spec, rank, models["actor"].model)
        first += spec.nproc
    return Plan(config, cluster, prompt_len, models, tuple(groups), tuple(host))


def delta_copy_bytes(config: PPOConfig, spec: GroupSpec, rank: int, model: ModelConfig) -> int:
    """sync_mode=delta: the bridge buckets a rank keeps in host memory (rollout/delta.py):
    the whole model on each rollout rank, its pipeline stage's tensors on the actor's sender
    of that stage (TP rank 0 of DP replica 0: the stage's first rank, in Megatron's tp-cp-ep-
    dp-pp order)."""
    if config.sync_mode != "delta":
        return 0
    if spec.roles == {"rollout"}:
        return total_params(model) * param_bytes(config)
    per_stage = spec.nproc // spec.parallel.pipeline_parallel
    if "actor" not in spec.roles or rank % per_stage:
        return 0
    whole = ParallelConfig(pipeline_parallel=spec.parallel.pipeline_parallel,
                           virtual_pipeline_parallel=spec.parallel.virtual_pipeline_parallel)
    return rank_params(model, whole, rank // per_stage) * param_bytes(config)


def residency(config: PPOConfig, role: str, what: str) -> dict:
    """Term fields (held, running, pinned) of a model role's model state under the job's
    switches: the worker's own table (ppo/residency.py), so the plan cannot drift from it."""
    kind = {"weights": "params", "grads": "grads", "optimizer": "optimizer"}[what]
    if not getattr(config, f"offload_{kind}"):
        return {"held": EVERY}
    held = frozenset(phase for phase, needs in phase_needs.HELD.items()
                     if kind in needs.get(role, ()))
    fields = {"held": held, "pinned": kind != "grads"}  # grads are dropped, not copied
    if kind == "params":
        fields["running"] = frozenset({"experience"})  # loaded for the role's forward
    return fields


def _stage(config: PPOConfig, spec: GroupSpec, models: dict[str, ModelSource],
           prompt_len: int, pp_rank: int, judge: ModelSource | None = None) -> Stage:
    nbytes, seq = param_bytes(config), prompt_len + config.max_new_tokens
    mesh = spec.parallel
    dp = mesh.data_parallel_size(spec.nproc)
    last = pp_rank == mesh.pipeline_parallel - 1
    train_rows = config.rows_per_step // (config.mini_batches * dp * config.micro_batches)
    exp_rows = config.rows_per_step // (dp * config.micro_batches)
    microbatches, mb_seq = config.micro_batches, seq
    budget = config.max_tokens_per_micro_batch
    if budget is not None:  # micro-batches of at most `budget` tokens, however many
        # At full length, the most there are (DP balancing may give a rank a row more).
        if config.pack_sequences:  # one row of up to `budget` tokens
            microbatches = -(-(train_rows + 1) * seq // budget)
            train_rows = exp_rows = 1
            mb_seq = budget
        else:
            per_micro_batch = max(1, budget // seq)
            microbatches = -(-(train_rows + 1) // per_micro_batch)
            train_rows = exp_rows = per_micro_batch
    experience, train = frozenset({"experience"}), frozenset({"train"})
    terms = []
    vllm_teachers = config.teacher_backend == "vllm"
    for role in models:  # each teacher a model of its own
        if role_of(role) not in spec.roles or (vllm_teachers and role_of(role) == "teacher"):
            continue
        model, trained = models[role].model, MODEL_ROLES[role_of(role)][2]
        parallel = config.parallel_of(role)  # the group's mesh, with the role's SP
        lm = not models[role].value_head
        n = rank_params(model, parallel, pp_rank, value_head=not lm)
        experts = rank_expert_params(model, parallel)
        lora = config.lora_of(role)
        if lora is not None:  # adapters train, the base and experts do not
            adapters = rank_adapter_params(model, parallel, lora)
            n, trainable, experts = n + adapters, adapters, 0
        else:
            trainable = None
            if role == "ref" and config.reference_adapter is not None:  # frozen, beside it
                n += rank_adapter_params(model, parallel, config.reference_adapter)
        # With the actor's adapters from zero the reference is the actor's own weights.
        if not (role == "ref" and config.reference_is_actor_base):
            terms += [Term(role, what, b, **residency(config, role, what))
                      # The distributed optimizer shards over DP x CP (CP ranks hold the
                      # same weights), experts over the ranks holding the same experts.
                      for what, b in memory.model_state(
                          n, nbytes, trained=trained, dp=dp * mesh.context_parallel,
                          expert_params=experts, trainable=trainable,
                          expert_dp=parallel.tensor_parallel * parallel.context_parallel
                          * dp // parallel.expert_group_size).items()]
        head = memory.lm_head_positions(parallel, mb_seq, config.max_new_tokens, seq) \
            if lm and last else 0
        terms.append(Term(role, "forward pass", memory.forward_pass(
            model, parallel, exp_rows, mb_seq, nbytes, logit_positions=head),
            running=experience))
        if trained:
            recompute = config.recompute_of(role)
            terms.append(Term(role, "activations", memory.train_activations(
                model, parallel, pp_rank, rows=train_rows, seq=mb_seq,
                microbatches=microbatches, param_bytes=nbytes, recompute=recompute),
                running=train))
            terms.append(Term(role, "backward", memory.backward_peak(
                model, parallel, train_rows, mb_seq, nbytes, recompute=recompute,
                logit_positions=head), running=train))
    actor = models["actor"].model
    if "actor" in spec.roles:  # the sender of the weight sync
        terms.append(Term("actor", "sync buffers", memory.sync_buffers(
            actor, config.parallel_of("actor"), lm_params=total_params(actor),
            param_bytes=nbytes, rollout_bytes=nbytes, bucket_bytes=DEFAULT_BUCKET_BYTES,
            lora=config.lora_of("actor") is not None), running=frozenset({"sync"})))
    if "rollout" in spec.roles:
        terms += _rollout_terms(config, spec, actor, prompt_len)
    if "judge" in spec.roles:
        terms += _judge_terms(config, spec, judge.model, prompt_len)
    if vllm_teachers and "teacher" in spec.roles:
        # An episode may take the models' whole room (the workers size with the same).
        length = fit_limit(config, models)[0] if config.episodic else seq
        for name in config.teachers:
            terms += _vllm_teacher_terms(config, name, models[name].model, length, seq)
    return Stage(pp_rank, tuple(terms))


def _vllm_teacher_terms(config: PPOConfig, name: str, model: ModelConfig, length: int,
                        seq: int) -> list[Term]:
    """A vLLM teacher's engine (teacher_backend=vllm, on ranks of its own): its weights and
    KV cache for good, and while it scores, the full-vocabulary logits of one sequence's
    positions (vLLM computes prompt logprobs a request at a time)."""
    tp, nbytes = config.parallel_of("teacher").tensor_parallel, param_bytes(config)
    size = config.teacher_engine_size(model, length, seq)
    return [Term(name, "weights", rank_params(model, ParallelConfig(tensor_parallel=tp), 0)
                 * nbytes, held=EVERY),
            Term(name, "KV cache", size.kv_cache_bytes, held=EVERY),
            Term(name, "scoring", memory.lm_logits(model, 1, 1, length, nbytes, backward=False),
                 running=frozenset({"experience"}))]


def _judge_terms(config: PPOConfig, spec: GroupSpec, model: ModelConfig, prompt_len: int
                 ) -> list[Term]:
    """reward_judge's engines (Megatron: one per DP replica of the group, at its TP; vLLM:
    judge_tp consecutive ranks each): their weights, and the KV cache and working set while
    they judge a rollout's samples (vLLM's cache allocated for good). Colocated with
    rollout_sleep, the weights are on the device in the rollout phase only, and a copy stays
    in pinned host memory (Megatron's, and vLLM's level-1 sleep); vLLM's cache is freed too.
    Its prompt: the sample, and the template counted as one token per character (more than
    any tokenizer makes)."""
    judge, nbytes = config.reward_judge, param_bytes(config)
    try:
        with open(judge.template) as f:
            template = len(f.read())
    except OSError:  # the run's preflight names it; the plan still sizes the rest
        template = 0
    seq = prompt_len + config.max_new_tokens + template + judge.max_new_tokens
    tp = config.judge_tp
    rollout = frozenset({"rollout"})
    weights = rank_params(model, ParallelConfig(tensor_parallel=tp), 0) * nbytes
    sleeps = config.rollout_sleep and "rollout" in spec.roles
    awake = rollout if sleeps else EVERY
    terms = [Term("judge", "weights", weights, held=awake, pinned=sleeps)]
    if judge.backend == "vllm":
        longest = min(seq, model.max_position_embeddings)
        limit = judge_limit(judge, longest, model.max_position_embeddings)
        size = config.judge_engine_size(model, longest, limit)
        return terms + [Term("judge", "KV cache", size.kv_cache_bytes, held=awake)]
    engines = spec.parallel.data_parallel_size(spec.nproc)
    rows = min(math.ceil(config.rows_per_step / engines), MegatronEngineConfig().max_batch_size)
    return terms + [
        Term("judge", "KV cache", memory.kv_cache(model, tp, rows, seq, nbytes),
             running=rollout),
        Term("judge", "generation", max(
            memory.inference_layer(model, tp, rows, seq, nbytes),
            memory.lm_logits(model, 1, rows, 1, nbytes, backward=False)), running=rollout)]


def _rollout_terms(config: PPOConfig, spec: GroupSpec, model: ModelConfig, prompt_len: int
                   ) -> list[Term]:
    """The engine's weights and KV cache (its share of the rollout batch at once), and the
    Megatron engine's generation working set; where each is on the device."""
    n, nbytes = config.samples_per_prompt, param_bytes(config)
    seq = prompt_len + config.max_new_tokens
    rollout = frozenset({"rollout"})
    extra = []
    if config.rollout_backend == "megatron":
        # One engine per DP replica, at the group's TP; it generates max_batch_size rows at a
        # time (a prompt's samples together), allocating the cache inside generate.
        tp = spec.parallel.tensor_parallel
        engines = spec.parallel.data_parallel_size(spec.nproc)
        per_batch = max(1, MegatronEngineConfig().max_batch_size // n)
        prompts = min(math.ceil(config.prompts_per_step / engines), per_batch)
        # Prefill caches the prompts once, then copies each prompt's rows for its samples,
        # one layer at a time.
        kv = Term("rollout", "KV cache", memory.kv_cache(model, tp, prompts * n, seq, nbytes)
                  + memory.kv_cache(model, tp, prompts, seq, nbytes) // model.num_layers,
                  running=rollout)
        # Generation's working set: the prefill's forward over the prompts, one layer at a
        # time, or a decode step's logits (megatron-core's static inference context
        # materialises the last position's only, gathered over TP: full vocabulary rows).
        extra.append(Term("rollout", "generation", max(
            memory.inference_layer(model, tp, prompts, prompt_len, nbytes),
            memory.lm_logits(model, 1, prompts * n, 1, nbytes, backward=False)),
            running=rollout))
    else:
        # vLLM pages its cache; the engines get their whole share of the batch at once, so
        # every sequence runs concurrently (rollout/sizing.py, which the workers use too). It
        # is allocated when the engine starts and freed only by sleep.
        tp = config.rollout_tp
        size = config.vllm_engine_size(model, prompt_len)
        rows = math.ceil(config.prompts_per_step / config.rollout_engines) * n
        kv_bytes = size.kv_cache_bytes if size.kv_cache_bytes is not None else \
            memory.kv_cache(model, tp, rows, size.max_model_len, nbytes)
        # Woken after the sync's weights, so also there for a checkpoint.
        kv = Term("rollout", "KV cache", kv_bytes, held=frozenset({"rollout", "checkpoint"})
                  if config.rollout_sleep else EVERY)
    weights = rank_params(model, ParallelConfig(tensor_parallel=tp), 0) * nbytes
    # Asleep from the end of rollout until the sync wakes its weights (then its cache).
    awake = frozenset({"rollout", "sync", "checkpoint"}) if config.rollout_sleep else EVERY
    terms = [Term("rollout", "weights", weights, held=awake), kv] + extra
    if config.placement != "colocated":  # the received buckets
        terms.append(Term("rollout", "sync buffers", memory.largest_bucket(
            model, tp, lm_params=total_params(model), rollout_bytes=nbytes,
            bucket_bytes=DEFAULT_BUCKET_BYTES), running=frozenset({"sync"})))
    return terms
