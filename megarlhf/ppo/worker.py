"""One rank of a PPO worker group: the model shards of the roles its group holds, on the
group's mesh (ppo/placement.py: colocated, one group holds every role; disaggregated, a group
per role set).

The controller calls the same method with the same arguments on every rank of a group (SPMD);
each method is collective over the group's mesh and returns the same result on every rank, so
the controller reads rank 0's. Batches are global: the roles cut out this rank's share.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import random
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist

from megarlhf.convert.peft_adapter import load_adapter
from megarlhf.data.sequences import SequenceBatch
from megarlhf.engine.checkpoint import (
    checkpoint_architecture, engine_from_checkpoint, is_complete, load_checkpoint, read_meta,
    save_checkpoint,
)
from megarlhf.engine.optim import OptimConfig
from megarlhf.engine.train import TrainEngine
from megarlhf.models.config import ModelConfig
from megarlhf.models.gpt import model_spec
from megarlhf.models.lora import adapters_off
from megarlhf.models.transformer_config import parse_dtype
from megarlhf.parallel.mesh import init_mesh
from megarlhf.ppo.config import PPOConfig
from megarlhf.ppo import residency
from megarlhf.ppo.layout import GroupSpec
from megarlhf.ppo.residency import Residency
from megarlhf.ppo.sources import TEACHER_LOGP, role_of
from megarlhf.profiling import PhaseProfiler
from megarlhf.rollout.bridge import WeightBridge, open_channel, receive
from megarlhf.rollout.delta import DeltaChannel
from megarlhf.rollout.engine import Completion, EngineError, SamplingParams
from megarlhf.rollout import projection, sizing
from megarlhf.rollout.sizing import EngineSize
from megarlhf.roles.batching import Batching
from megarlhf.roles.policy import PolicyInputs, PolicyLossConfig, PolicyRole
from megarlhf.roles.value import ValueLossConfig, ValueRole
from megarlhf.roles.vllm_teacher import VLLMTeacher


_ENGINE_SEED = 0x9E3779B97F4A7C15
"""Odd 64-bit constant between the seeds of a call's engines (engine 0 keeps the call's)."""


def _phase(name: str):
    """A loop phase's method, profiled as `name` in the steps the controller profiles."""
    def wrap(method):
        @functools.wraps(method)
        def profiled(self, *args):
            with self.profiler.phase(name):
                return method(self, *args)
        return profiled
    return wrap


def _rows(batch: SequenceBatch, rows: slice) -> SequenceBatch:
    return SequenceBatch(tokens=batch.tokens[rows], attention_mask=batch.attention_mask[rows],
                         response_mask=batch.response_mask[rows])


class PPOWorker:
    def __init__(self, config: PPOConfig, group: GroupSpec,
                 engine_sizes: dict[str, EngineSize] | None = None):
        """`engine_sizes`: the vLLM engines' sizes the controller's preflight computed
        ("rollout", "judge", each vLLM teacher's name)."""
        self.config, self.group, self.engine_sizes = config, group, engine_sizes or {}
        c, roles = config, group.roles
        self.mesh = init_mesh(group.parallel, seed=c.seed, timeout_s=c.collective_timeout_s)
        self.rank = self.mesh.rank
        self.dtype = parse_dtype(c.dtype)
        self.profiler = PhaseProfiler(c.out_dir, f"{group.name}_rank{self.rank}")
        self.actor = self.ref = self.critic = self.reward = None
        self.teachers: dict[str, PolicyRole | VLLMTeacher] = {}
        """PPOConfig.teachers' name -> its frozen model (the group's "teacher" role), or its
        vLLM engines (teacher_backend=vllm)."""
        o = c.options
        norm = (c.aggregation_norm or c.max_new_tokens
                if o.aggregation == "seq_mean_token_sum_norm" else None)
        batching = Batching(num_microbatches=c.micro_batches,
                            max_tokens=c.max_tokens_per_micro_batch, pack=c.pack_sequences,
                            share_prompts=c.share_prompts and not c.pack_sequences)
        if "actor" in roles:
            loss = PolicyLossConfig(
                clip_eps=o.clip_eps, clip_eps_high=o.clip_eps_high, dual_clip=c.dual_clip,
                ratio_level=o.ratio_level, kind=o.policy_loss,
                log_ratio_clamp=c.log_ratio_clamp, entropy_coef=c.entropy_coef,
                aggregation=o.aggregation, aggregation_norm=norm, kl_estimator=o.kl_estimator,
                kl_clamp=c.kl_clamp)
            self.actor = PolicyRole(self._engine("actor", c.actor, c.actor_lr), loss=loss,
                                    batching=batching)
        if "ref" in roles:
            # With LoRA from zero the reference is the actor's own engine with its adapters
            # off: the base is frozen, so it is the initial policy.
            self.ref = PolicyRole(self.actor.engine if c.reference_is_actor_base else
                                  self._engine("ref", c.actor, None), batching=batching)
        if "critic" in roles:
            self.critic = ValueRole(self._engine("critic", c.critic, c.critic_lr),
                                    loss=ValueLossConfig(clip_eps=c.value_clip_eps,
                                                         aggregation=o.aggregation,
                                                         aggregation_norm=norm),
                                    batching=batching)
        if "reward" in roles:
            self.reward = ValueRole(self._engine("reward", c.reward_model, None),
                                    batching=batching)
        if "teacher" in roles and c.teacher_backend == "vllm":
            tp = c.parallel_of("teacher").tensor_parallel
            self.teachers = {name: VLLMTeacher(
                                 self._vllm_engine(name, path, tp, load_format="auto",
                                                   sleeps=False),
                                 rank=self.rank, world_size=self.mesh.world_size,
                                 tensor_parallel=tp, device=self.mesh.device)
                             for name, path in c.teachers.items()}
        elif "teacher" in roles:
            self.teachers = {name: PolicyRole(self._teacher_engine(name, path),
                                              batching=batching)
                             for name, path in c.teachers.items()}
        model, arch = self._actor_model()
        self.bridge = self.engine = self.channel = self.delta = None
        if self.actor is not None:
            self.bridge = WeightBridge(self.actor.engine.chunks, self.mesh, model, arch,
                                       lora=c.lora_of("actor"))
        # A colocated judge sleeps between its calls with the rollout engine's rollout_sleep;
        # on ranks of its own nothing else wants the memory.
        self._judge_sleeps = c.rollout_sleep and "rollout" in roles
        self.judge_engine = self._judge_engine() if "judge" in roles else None
        # A Megatron judge's weights count in the phases' memory (vLLM's live in its own
        # allocator).
        counted = self.judge_engine is not None and c.reward_judge.backend == "megatron"
        self.residency = Residency(
            {role: r.engine for role, r in self._models().items()
             if not (role == "ref" and c.reference_is_actor_base)
             and not isinstance(r, VLLMTeacher)},  # vLLM's memory is its own
            params=c.offload_params, grads=c.offload_grads, optimizer=c.offload_optimizer,
            engines={"judge": self.judge_engine} if counted else {})
        if "rollout" in roles:
            self.engine = self._rollout_engine(model, arch.name)
            self._output_name = projection.output_name(
                arch.rules(model, lm_head=True, value_head=False), model.tie_embeddings)
            self._hidden = model.hidden_size

    def _models(self) -> dict:
        """role -> its PolicyRole / ValueRole, for the model roles this group holds (each
        teacher under its name)."""
        return {role: r for role, r in (("actor", self.actor), ("ref", self.ref),
                                        ("critic", self.critic), ("reward", self.reward),
                                        *self.teachers.items())
                if r is not None}

    def _engine_sleeps(self) -> None:
        """The rollouts are over until the weight sync: free the engine's memory."""
        if self.engine is not None and self.config.rollout_sleep:
            self.engine.sleep()

    def _engine(self, role: str, ckpt: str, lr: float | None) -> TrainEngine:
        """Model role `role` on the group's mesh, at its own layout: the mesh's TP x PP with
        the role's sequence parallelism (a per-model flag; the ranks' megatron-core parallel
        state is the group's) and its activation recomputation. An actor starting from a PEFT
        adapter, and its reference, get that adapter over the checkpoint's weights (a resume
        then loads the actor's trained adapters over it)."""
        optim = OptimConfig(lr=lr, clip_grad=1.0) if lr is not None else None
        parallel = self.config.parallel_of(role)
        if not parallel.same_mesh(self.group.parallel):
            raise ValueError(f"{role}'s layout {parallel} is not its group's mesh "
                             f"{self.group.parallel} (the config's checks should have said)")
        lora = self.config.reference_adapter if role == "ref" else self.config.lora_of(role)
        engine = engine_from_checkpoint(ckpt, parallel, self.mesh, optim, dtype=self.dtype,
                                        lora=lora, layer_spec=self.config.layer_spec,
                                        recompute=self.config.recompute_of(role))
        if lora is not None and lora.from_peft is not None:
            load_adapter(lora.from_peft, engine.unwrapped())
            engine.refresh_masters()
        return engine

    def _teacher_engine(self, name: str, path: str) -> TrainEngine:
        """Teacher `name`'s frozen model at its layout (PPOConfig.parallel_of: the actor's,
        or layout.teacher on ranks of its own): a checkpoint loaded as every role's is, or an
        HF directory's tensors streamed in under their HF names (as a Megatron judge's are;
        nothing converted on disk)."""
        if is_complete(path):
            return self._engine("teacher", path, None)
        from megarlhf.ppo.judge import judge_model
        from megarlhf.rollout.megatron_engine import HFWeights

        source = judge_model(path, name)
        parallel = self.config.parallel_of("teacher")
        engine = TrainEngine(model_spec(source.model, parallel, dtype=self.dtype,
                                        layer_spec=self.config.layer_spec), self.mesh, None)
        HFWeights(engine.chunks, source.model, source.arch_name, name,
                  whole=parallel.pipeline_parallel == 1).load(source.weights(), self.mesh.device)
        return engine

    def _actor_model(self):
        """The actor's model config and architecture (HF names for the bridge and engines)."""
        meta = read_meta(self.config.actor)
        return ModelConfig.from_dict(meta["model"]), checkpoint_architecture(meta)

    def _rollout_engine(self, model: ModelConfig, arch_name: str):
        c = self.config
        if c.rollout_backend == "vllm":
            return self._vllm_engine("rollout", c.vllm_model_dir, c.rollout_tp,
                                     load_format="dummy",
                                     prefix_caching=c.episodic)
        from megarlhf.rollout.megatron_engine import MegatronEngine, MegatronEngineConfig

        return MegatronEngine(model_spec(model, self.group.parallel, dtype=self.dtype,
                                         layer_spec=c.layer_spec),
                              self.mesh, MegatronEngineConfig(architecture=arch_name,
                                                              return_routing=c.routing_replay))

    def _vllm_engine(self, kind: str, model_dir: str, tp: int, *, load_format: str,
                     prefix_caching: bool = False, sleeps: bool = True):
        """A vLLM engine of `tp` consecutive ranks of this group, sized by the controller's
        preflight (engine_sizes[kind]: "rollout", "judge" or a teacher's name)."""
        from megarlhf.rollout.vllm_engine import VLLMEngine, VLLMEngineConfig

        size = self.engine_sizes.get(kind)
        if size is None:
            raise ValueError("vLLM engines need the engine size the controller's preflight "
                             "computes")
        try:
            return VLLMEngine(VLLMEngineConfig(
                model_dir=model_dir, seed=self.config.seed, tensor_parallel_size=tp,
                max_model_len=size.max_model_len, kv_cache_memory_bytes=size.kv_cache_bytes,
                gpu_memory_utilization=size.gpu_memory_utilization,
                block_size=sizing.BLOCK_TOKENS, load_format=load_format,
                enforce_eager=not self.config.rollout_cuda_graphs,
                prefix_caching=prefix_caching, sleeps=sleeps,
                dtype=str(self.dtype).removeprefix("torch.")))
        except EngineError as e:
            raise EngineError(f"{e} [started with max_model_len={size.max_model_len}, "
                              f"kv_cache_bytes={size.kv_cache_bytes}, gpu_memory_utilization="
                              f"{size.gpu_memory_utilization}; the rollout engines' are set by "
                              f"rollout_max_model_len, rollout_kv_cache_bytes, rollout_gpu_"
                              f"memory_utilization, a judge's from its positions, a teacher's "
                              f"from the run's longest sequence]") from e

    def _judge_engine(self):
        """reward_judge's model on engines of this group's TP: Megatron (its HF directory's
        or Megatron checkpoint's tensors streamed in one by one; colocated with rollout_sleep,
        kept in host memory while it sleeps) or vLLM (which reads the HF directory itself)."""
        judge = self.config.reward_judge
        if judge.backend == "vllm":
            engine = self._vllm_engine("judge", judge.model, self.config.judge_tp,
                                       load_format="auto")
            if self._judge_sleeps:
                engine.sleep(keep_weights=True)  # until the first judge call
            return engine
        from megarlhf.ppo.judge import judge_model
        from megarlhf.rollout.megatron_engine import MegatronEngine, MegatronEngineConfig

        source = judge_model(judge.model)
        engine = MegatronEngine(model_spec(source.model, self.group.parallel, dtype=self.dtype,
                                           layer_spec=self.config.layer_spec),
                                self.mesh, MegatronEngineConfig(architecture=source.arch_name))
        engine.update_weights(source.weights())
        if self._judge_sleeps:
            engine.sleep(keep_weights=True)  # until the first judge call
        return engine

    def open_channel(self, host: str, port: int) -> None:
        """Disaggregated: join the weight channel. Its members are the actor's senders (TP
        rank 0 of DP replica 0 of each pipeline stage: channel ranks 0..PP-1) and every
        rollout rank (PP..); the actor's other ranks only help assemble tensors (TP) or hold
        copies (DP, CP)."""
        pp = self.config.parallel_of("actor").pipeline_parallel
        size = pp + self.config.rollout_nproc
        timeout = self.config.collective_timeout_s
        if self.engine is not None:
            self.channel = open_channel(host, port, pp + self.rank, size, timeout_s=timeout)
        elif self.mesh.tp_rank == 0 and self.mesh.dp_rank == 0 and self.mesh.cp_rank == 0:
            self.channel = open_channel(host, port, self.mesh.pp_rank, size, timeout_s=timeout)
        if self.channel is not None and self.config.sync_mode == "delta":
            self.delta = DeltaChannel(self.channel, engine=self.engine is not None)

    # -- the loop's phases -----------------------------------------------------------------

    @_phase("rollout")
    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 keys: list[int] | None) -> list[Completion]:
        """Completions of all prompts, on every rank. Prompts are dealt over the engines by
        their `keys` (default: their positions) modulo the engines, every rank of an engine
        generating the same share, and each engine's results gathered once: vLLM engines of
        rollout_tp consecutive ranks, or one Megatron engine per DP replica (it spans the
        replica's TP group). The turns of a multi-turn episode keep one key, so they reach
        the engine that holds the episode's earlier turns in its prefix cache."""
        self.residency.keep("rollout", residency.ROLLOUT)
        vllm = self.config.rollout_backend == "vllm"
        return self._deal(self.engine, self.config.rollout_tp if vllm else None, prompts,
                          params, keys)

    @_phase("judge")
    def judge(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """The judge engines' completions of its prompts, on every rank: one Megatron engine
        per DP replica, or vLLM engines of judge_tp consecutive ranks. A colocated judge with
        rollout_sleep wakes with the weights it kept (in host memory) and sleeps again
        after."""
        engine = self.judge_engine
        self.residency.keep("judge", residency.ROLLOUT)  # the rest off first
        if self._judge_sleeps:
            engine.wake()
            self.residency.note("judge")
        try:
            vllm = self.config.reward_judge.backend == "vllm"
            return self._deal(engine, self.config.judge_tp if vllm else None, prompts, params,
                              None)
        finally:
            if self._judge_sleeps:
                engine.sleep(keep_weights=True)

    def _deal(self, engine, vllm_tp: int | None, prompts: list[list[int]],
              params: SamplingParams, keys: list[int] | None) -> list[Completion]:
        """`engine`'s completions of the prompts dealt over the engines (see generate):
        vLLM engines of `vllm_tp` ranks, or (None) one Megatron engine per DP replica."""
        if vllm_tp is not None:
            tp = vllm_tp
            share, count, group = self.rank // tp, self.mesh.world_size // tp, None
            # An engine's ranks all hold its completions: its first rank speaks for it.
            speaks = self.rank % tp == 0
        else:
            share, count, group = self.mesh.dp_rank, self.mesh.dp_size, self.mesh.dp_group
            speaks = True  # dp_group holds one rank of each engine
        keys = keys if keys is not None else range(len(prompts))
        mine = [i for i, key in enumerate(keys) if key % count == share]
        if params.seed is not None and share:
            # Each engine draws its samples' seeds from the call's seed: engines of their own
            # must not share one, or equal prompts on two of them (the episodes of a prompt)
            # would be sampled alike.
            params = dataclasses.replace(params, seed=(params.seed + share * _ENGINE_SEED)
                                         % 2**63)
        local = engine.generate([prompts[i] for i in mine], params.for_prompts(mine)) \
            if mine else []
        local = [dataclasses.replace(c, prompt_index=mine[c.prompt_index])
                 for c in local if speaks]
        parts = [None] * dist.get_world_size(group)
        dist.all_gather_object(parts, local, group=group)
        merged = [c for part in parts for c in part]
        # A rank gathered twice (or not at all) would silently reweight the batch.
        if len(merged) != len(prompts) * params.n:
            raise RuntimeError(f"the engines returned {len(merged)} completions for "
                               f"{len(prompts)} prompts x {params.n} samples")
        return sorted(merged, key=lambda c: c.prompt_index)  # stable: samples keep order

    @_phase("experience")
    def experience(self, batch: SequenceBatch, roles: frozenset[str],
                   routing: torch.Tensor | None) -> dict[str, torch.Tensor]:
        """What this group's roles among `roles` add to the rollout batch: old logprobs and
        entropy (actor; through the engine's expert `routing` when given, with the fraction
        of it the actor's routers would have chosen otherwise), ref logprobs, values
        (critic), reward-model scores (reward), the teacher's logprobs of the same tokens."""
        self._engine_sleeps()
        out = {}
        for role, model in self._models().items():
            if role_of(role) not in roles:
                continue
            # One role's weights at a time, when they are offloaded (LoRA's reference is the
            # actor's weights).
            shares_actor = role == "ref" and self.config.reference_is_actor_base
            self.residency.keep("experience",
                                residency.forward_of("actor" if shares_actor else role))
            if role == "actor":
                out["logp"], out["entropy"] = model.logprobs(batch, with_entropy=True,
                                                             routing=routing)
                if routing is not None:
                    out["routing_moved"] = torch.tensor(model.routing_moved())
            elif role == "ref":
                with adapters_off(model.engine.chunks) if shares_actor else nullcontext():
                    out["ref_logp"] = model.logprobs(batch)
            elif role in self.teachers:  # the controller picks each row's teacher
                out[TEACHER_LOGP + role] = model.logprobs(batch)
            elif role == "critic":
                out["values"] = model.values(batch)
            else:
                out["rm_scores"] = model.scores(batch)
        return out

    @_phase("train")
    def train(self, batch: SequenceBatch, old_logp: torch.Tensor | None,
              advantages: torch.Tensor, old_values: torch.Tensor | None,
              returns: torch.Tensor | None, loss_mask: torch.Tensor,
              policy: PolicyInputs | None) -> tuple[list[dict], dict[str, torch.Tensor]]:
        """PPO epochs over mini-batches for this group's actor and/or critic: the metrics of
        every optimizer step, and with `old_logp` None (one_pass_old_logprobs: one update
        pass, whose own logprobs are the old ones) the actor's logp and entropy [B, T] from
        that pass (and routing_moved with a routing), as `experience` would have given them.
        `loss_mask` [B, T]: the response tokens trained (a sample whose score failed has
        none); a mini-batch without any takes no optimizer step (it has no gradient to take
        one with). `policy`: the actor's inputs (None in a group without the actor)."""
        c = self.config
        self._engine_sleeps()
        self.residency.keep("train", residency.TRAIN)
        size = batch.shape[0] // c.mini_batches
        metrics, own = [], {}
        if old_logp is None and (c.ppo_epochs, c.mini_batches) != (1, 1):
            raise ValueError("the update pass gives the old logprobs only as the batch's one "
                             "update (ppo_epochs=1, mini_batches=1)")

        def check(logp, entropy):  # the update pass's own logprobs, before its optimizer step
            own.update(logp=logp, entropy=entropy)
            guard = policy.gap_guard
            return guard is None or guard.allows_step(logp, batch.response_mask)

        for _ in range(c.ppo_epochs):
            for k in range(c.mini_batches):
                rows = slice(k * size, (k + 1) * size)
                if not bool(loss_mask[rows].any()):
                    continue
                part = _rows(batch, rows)
                m = {}
                if self.actor is not None:
                    one_pass = old_logp is None
                    step, actor = self.actor.train_step(
                        part, None if one_pass else old_logp[rows], advantages[rows],
                        **policy.rows(rows), loss_mask=loss_mask[rows],
                        check_logprobs=check if one_pass else None)
                    if one_pass and policy.routing is not None:
                        own["routing_moved"] = torch.tensor(actor["routing_replay_moved"])
                    m.update({f"actor/{k}": v for k, v in actor.items()})
                    m.update({"actor/grad_norm": step.grad_norm, "actor/lr": step.lr,
                              "actor/skipped": float(step.skipped)})
                    if step.moe_load is not None:
                        m["actor/moe_load"] = step.moe_load
                if self.critic is not None:
                    vstep, critic = self.critic.train_step(part, old_values[rows],
                                                           returns[rows],
                                                           loss_mask=loss_mask[rows])
                    m.update({f"critic/{k}": v for k, v in critic.items()})
                    m["critic/grad_norm"] = vstep.grad_norm
                    if vstep.moe_load is not None:
                        m["critic/moe_load"] = vstep.moe_load
                metrics.append(m)
        self.residency.note("train")
        return metrics, own

    @_phase("sync")
    def sync_weights(self, whole: bool) -> dict[str, float]:
        """The actor's weights into the rollout engines: streamed inside this rank
        (colocated), or sent (actor group) / received (rollout group) over the channel. A
        sleeping engine wakes in stages: its weights, the sync, then its KV cache. With
        sync_mode=delta, `whole` sends every bucket whole. Returns, on a rollout rank of a
        delta sync, what the sync moved (sync/* metrics)."""
        if self.bridge is not None and self.engine is not None:
            self.residency.keep("sync", residency.SYNC)
            self.engine.wake(("weights",))
            self._update_engine(self.bridge.stream(reuse_buffer=self.engine.copies_each_bucket))
            self.residency.keep("sync", residency.ROLLOUT)
            self.engine.wake(("kv_cache",))
            return {}
        if self.delta is not None:
            self.delta.start(whole)
        if self.bridge is not None:
            self.bridge.send(self.channel, self.delta)
            return {}
        self._update_engine(receive(self.channel, self.delta))
        return {} if self.delta is None else self.delta.stats.metrics()

    def _update_engine(self, stream) -> None:
        """The stream into the engine, then the engine's output projection, read back through
        its own kernels, held to the streamed one (rollout/projection.py)."""
        recorder = projection.Recorder(self._output_name)
        self.engine.update_weights(recorder.wrap(stream))
        start, products = self.engine.output_products(projection.vectors(self._hidden))
        recorder.check(self.engine.name, start, products, self.dtype)

    def profile(self, step: int) -> None:
        """Profile this rank's phases until take_profile (profile: true)."""
        self.profiler.start(step)

    def take_profile(self) -> dict[str, dict]:
        """phase -> this rank's table of the profiled step (megarlhf/profiling.py)."""
        return self.profiler.take()

    def take_memory(self) -> dict[str, int]:
        """phase -> the most bytes of this rank's model state on the device in it, since the
        last call."""
        return self.residency.take_peaks()

    # -- checkpoints -------------------------------------------------------------------------

    @property
    def _has_rng(self) -> bool:
        """A judge-only group draws nothing from its RNGs (its calls carry their seeds), nor
        does a teacher-only one (forward passes), so a checkpoint keeps none of theirs: a
        resume may add or resize them."""
        return self.group.roles not in ({"judge"}, {"teacher"})

    def save(self, directory: str) -> None:
        """The trained models with their optimizers, and every rank's RNG states."""
        self.residency.keep("checkpoint", residency.CHECKPOINT)
        if self.actor is not None:
            save_checkpoint(os.path.join(directory, "actor"), self.actor.engine, self.mesh)
        if self.critic is not None:
            save_checkpoint(os.path.join(directory, "critic"), self.critic.engine, self.mesh)
        if self._has_rng:
            os.makedirs(os.path.join(directory, "rng"), exist_ok=True)
            torch.save({"torch": torch.get_rng_state(), "python": random.getstate(),
                        "numpy": np.random.get_state()}, self._rng_path(directory))
        dist.barrier()

    def load(self, directory: str) -> None:
        """Undo save(); the rollout engines need a weight sync afterwards."""
        self.residency.keep("checkpoint", residency.CHECKPOINT)
        for role in (self.actor, self.critic):
            if role is None:
                continue
            path = os.path.join(directory, "actor" if role is self.actor else "critic")
            # A run's checkpoint holds no optimizer state only if its optimizer had not
            # stepped yet (every step so far trained nothing: all samples failed, or
            # skipped): the fresh optimizer is that state.
            load_checkpoint(path, role.engine, with_optimizer=read_meta(path)["with_optimizer"])
        self.residency.note("checkpoint")
        if not self._has_rng:
            return
        rng = torch.load(self._rng_path(directory), weights_only=False)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])

    def _rng_path(self, directory: str) -> str:
        # Named without the teachers, which draw nothing: whether they run in the actor's
        # group (teacher_nproc unset) may change on a resume.
        name = "+".join(part for part in self.group.name.split("+") if part != "teacher")
        return os.path.join(directory, "rng", f"{name or self.group.name}-rank{self.rank}.pt")

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
        if self.judge_engine is not None:
            self.judge_engine.shutdown()
        for teacher in self.teachers.values():
            if isinstance(teacher, VLLMTeacher):
                teacher.shutdown()

