"""Mixture-of-experts models under expert parallelism against the EP1 / TP1 run on the same
weights and data (gloo, CPU, fp32): logits, and five training steps (loss, token count, grad
norm) with the load-balancing loss on.

Tolerances as in test_parallel_equivalence (fp32 summation order only: 1e-5). The router's
top-k is a discrete choice, so a layout that computed the router's logits differently
enough to flip one token's experts would move the loss by far more than that.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from megarlhf.data.embedded import byte_batches
from megarlhf.parallel import ParallelConfig as P
from megarlhf.parallel import launch_local
from tests import workers

pytestmark = pytest.mark.slow
ATOL = 1e-5

LAYOUTS = {
    # name: (layout, ranks, micro-batches); every run's micro-batches hold one row each, so
    # the load-balancing loss (computed per micro-batch) sees the same tokens in every layout.
    "ep2": (P(expert_parallel=2), 2, 2),
    "tp2sp_ep2": (P(tensor_parallel=2, sequence_parallel=True, expert_parallel=2), 2, 4),
    "pp2_ep2": (P(pipeline_parallel=2, expert_parallel=2), 4, 2),
    "ep2_etp2": (P(expert_parallel=2, expert_tensor_parallel=2), 4, 1),
    "cp2_ep2": (P(context_parallel=2, expert_parallel=2), 2, 4),
    # Without EP the experts split over the TP ranks like any MLP (expert_tp = TP).
    "tp2sp": (P(tensor_parallel=2, sequence_parallel=True), 2, 4),
}


@pytest.fixture(scope="module")
def moe(tiny):
    """The tiny preset with 4 experts of width 32 per layer, top-2, aux loss on."""
    return dataclasses.replace(tiny, num_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2,
                               moe_aux_loss_coeff=0.01)


@pytest.fixture(scope="module")
def moe_ref(moe, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("moe") / "lm")
    launch_local(workers.write_reference, 1, path, moe, 0)
    return path


@pytest.fixture(scope="module")
def batches():
    out = byte_batches(seq=16, batch=4, steps=5)
    for b in out:
        b["loss_mask"][0, :8] = 0  # uneven token counts per rank
    return out


@pytest.fixture(scope="module")
def ref_curve(moe, moe_ref, batches):
    """DP2 at EP1, two one-row micro-batches per rank."""
    curve = launch_local(workers.train_curve, 2, moe_ref, moe, P(), batches, microbatches=2)[0]
    losses = [step[0] for step in curve]
    assert losses[-1] < losses[0] - 0.05, f"training did not reduce the loss: {losses}"
    return curve


def test_the_load_balancing_loss_reaches_the_gradients(moe, moe_ref, batches, ref_curve):
    without = dataclasses.replace(moe, moe_aux_loss_coeff=0.0)
    curve = launch_local(workers.train_curve, 2, moe_ref, without, P(), batches[:1],
                         microbatches=2)[0]
    assert curve[0][0] == pytest.approx(ref_curve[0][0], rel=1e-6)  # same LM loss reported
    assert abs(curve[0][2] - ref_curve[0][2]) > 1e-4 * ref_curve[0][2]  # other gradients


def routed_counts_and_load(ckpt: str, model, parallel, batch: dict, microbatches: int):
    """One training step: the engine's reported expert load, and this rank's own count of
    tokens per expert per layer (a hook of the test's own on every router)."""
    from megatron.core.transformer.moe.router import TopKRouter

    from megarlhf.engine.checkpoint import load_checkpoint
    from megarlhf.engine.losses import lm_loss
    from megarlhf.engine.schedule import rank_microbatches
    from megarlhf.engine.train import TrainEngine
    from megarlhf.parallel.mesh import init_mesh

    mesh = init_mesh(parallel)
    engine = TrainEngine(workers.make_spec(model, parallel), mesh, workers.OPTIM)
    load_checkpoint(ckpt, engine, with_optimizer=False)
    counts: dict[int, torch.Tensor] = {}

    def count(router, _inputs, outputs):
        counts[router.layer_number] = counts.get(router.layer_number, 0) + outputs[1].sum(0)

    for module in engine.unwrapped()[0].modules():
        if isinstance(module, TopKRouter):
            module.register_forward_hook(count)
    step = engine.train_step(rank_microbatches(batch, mesh, microbatches),
                             lm_loss(mesh, model.vocab_size))
    return step.moe_load, {k: v.tolist() for k, v in counts.items()}


def test_expert_load_is_the_busiest_ep_ranks_share_of_the_routed_tokens(moe, moe_ref):
    """The reported ratio at EP2 against one that counts every token on one rank and splits
    the experts into EP2's halves by hand."""
    batch = workers.make_batch(moe, batch=4, seq=16, seed=3)
    (ep1_load, counts), = launch_local(routed_counts_and_load, 1, moe_ref, moe, P(), batch, 4)
    assert ep1_load == 1.0  # one EP rank holds every expert
    expected = 0.0
    for per_expert in counts.values():
        halves = torch.tensor(per_expert, dtype=torch.float64).view(2, 2).sum(dim=1)
        assert halves.sum() == 4 * 16 * moe.moe_router_topk  # every token's k experts
        expected = max(expected, float(halves.max() / halves.mean()))
    assert expected > 1.0  # the random router is not perfectly even
    for load, _ in launch_local(routed_counts_and_load, 2, moe_ref, moe, P(expert_parallel=2),
                                batch, 2):
        assert load == pytest.approx(expected, rel=1e-12)


def test_logits_equal_ep1(moe, moe_ref):
    batch = workers.make_batch(moe, batch=4, seq=16, seed=1)
    # TP2 at EP2 without sequence parallelism runs forward (megatron-core trains it only
    # with SP).
    cases = {"ref": (P(), 1), "tp2_ep2": (P(tensor_parallel=2, expert_parallel=2), 2)}
    cases |= {n: LAYOUTS[n][:2] for n in ("ep2", "ep2_etp2")}
    outs = {}
    for name, (parallel, nprocs) in cases.items():
        outs[name] = launch_local(workers.forward_outputs, nprocs, moe_ref, parallel, batch)
    ref = outs.pop("ref")[0]
    assert ref.std() > 0.1
    for name, per_rank in outs.items():
        for rank, out in enumerate(per_rank):
            torch.testing.assert_close(out, ref, atol=ATOL, rtol=0, msg=f"{name} rank {rank}")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_train_curve_equals_ep1(layout, moe, moe_ref, batches, ref_curve):
    parallel, nprocs, microbatches = LAYOUTS[layout]
    out = launch_local(workers.train_curve, nprocs, moe_ref, moe, parallel, batches,
                       microbatches=microbatches)
    workers.assert_same_curves(out, ref_curve)


def test_expert_parallel_equals_ep1_through_the_controller(moe, moe_ref, tmp_path):
    """PPO with a mixture-of-experts actor and critic (value head on the MoE trunk),
    disaggregated with a Megatron rollout rank (the same engine and samples for any trainer
    layout): every role at EP2 (each rank half the experts) against EP1, both DP2. The actor
    trains LoRA adapters on its attention (frozen experts and router; its reference is its
    base with the adapters off, so no reference group), synced merged; the critic trains
    every weight, experts included. Tolerance as the CP one's (tests/test_ppo.py): rel 1e-5,
    abs 1e-6 near 0."""
    from megarlhf.models.lora import LoraConfig
    from megarlhf.ppo.config import Layout, PPOConfig, RoleLayout
    from megarlhf.ppo.controller import run
    from megarlhf.ppo.layout import group_specs
    from tests.test_ppo import _without_timings

    critic = str(tmp_path / "critic")
    launch_local(workers.write_reference, 1, critic, moe, 1, True)
    g = torch.Generator().manual_seed(0)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": torch.randint(
        1, 300, (3 + 2 * (i % 2),), generator=g).tolist()}) + "\n" for i in range(16)))
    # actor_lr 3e-3: the first update still moves the policy (step 2's KL to the reference
    # 0.012), while 3e-2 amplified fp32 rounding of the EP layouts' expert sums into a 1.9e-5
    # relative difference of step 2's actor grad norm on some sampled batches.
    base = PPOConfig(actor=moe_ref, critic=critic, prompts=str(prompts),
                     reward_fn="tests.ppo_tasks:low_token_fraction", nproc=2, steps=2,
                     prompts_per_step=4, samples_per_prompt=2, max_new_tokens=8, ppo_epochs=2,
                     mini_batches=2, actor_lr=3e-3, critic_lr=1e-3, kl_coef=0.01,
                     placement="disaggregated", out_dir=str(tmp_path / "ep1"),
                     layout=Layout(actor=RoleLayout(lora=LoraConfig(
                         rank=4, target_modules=["q_proj", "v_proj", "o_proj"]))))
    ep1 = run(base)
    config = dataclasses.replace(base, out_dir=str(tmp_path / "ep2"), expert_parallel=2)
    assert [(g.name, g.parallel.expert_parallel) for g in group_specs(config)] == [
        ("actor+ref", 2), ("critic", 2), ("rollout", 1)]
    ep2 = run(config)
    for step, (ours, theirs) in enumerate(zip(ep2, ep1), start=1):
        strip = {k: v for k, v in _without_timings(theirs).items()
                 if not k.startswith("memory/")}  # bytes per rank: the layouts differ
        strip = {k: v for k, v in strip.items() if not k.endswith("/moe_load")}  # EP1: 1.0
        assert {k: ours[k] for k in strip} == pytest.approx(strip, rel=1e-5, abs=1e-6), step
        assert theirs["actor/moe_load"] == 1.0 and 1.0 <= ours["actor/moe_load"] <= 2.0
    assert len(ep2) == 2 and ep2[-1]["actor/grad_norm"] > 0 and ep2[-1]["critic/grad_norm"] > 0
    # The adapters moved the policy away from its base (the reference): KL 0 at step 1 only.
    assert ep2[0]["kl"] == 0 and ep2[1]["kl"] != 0


HF_PPO_RUNS = {
    # name: (architecture, rollout backend, placement, expert_parallel); the Megatron engine
    # runs with routing replay (vLLM's routing is refused, docs/guides/moe.md).
    "qwen3_moe-vllm-colocated": ("qwen3_moe", "vllm", "colocated", 1),
    "qwen3_moe-megatron-replay-colocated": ("qwen3_moe", "megatron", "colocated", 1),
    "mixtral-megatron-replay-disaggregated-ep2": ("mixtral", "megatron", "disaggregated", 2),
    "mixtral-vllm-disaggregated-ep2": ("mixtral", "vllm", "disaggregated", 2),
}


@pytest.mark.parametrize("run_name", list(HF_PPO_RUNS))
def test_hf_moe_models_run_ppo_steps(tmp_path, run_name):
    """Toy HF Qwen3-MoE (unnormalised top-k, expert width 48) and Mixtral, converted, run
    GRPO steps through the controller with both rollout engines, colocated at EP1 and
    disaggregated at EP2 (the bridge gathers the experts for the engine's rank). The rollout's
    logprobs match the trainer's at the fp32 level (<= 2e-5, test_ppo's vLLM tolerance).
    With routing_replay the experience pass replays the engine's routing on the engine's own
    weights: no routing moved (rollout/routing_replay_moved 0, as
    test_engine_routing_replays_in_the_trainer measures token by token); the update passes
    replay it after the actor's first mini-batch update too, when the routers would move some
    tokens (actor/routing_replay_moved > 0; measured 0.26-0.35 of them: a toy router's logits
    are small next to an Adam step). Disaggregated, the sync is sync_mode=delta (fp32: most
    elements move each step, so most buckets go whole, all through the delta channel's
    checks)."""
    from megarlhf.convert.hf_to_mcore import hf_to_mcore
    from megarlhf.ppo.config import PPOConfig
    from megarlhf.ppo.controller import run
    from tests import hf_models

    arch, backend, placement, ep = HF_PPO_RUNS[run_name]
    if backend == "vllm":
        pytest.importorskip("vllm")
    # head_dim 32: one vLLM's CPU attention serves (hf_models' Mixtral has 16)
    hf_dir = hf_models.save_model(str(tmp_path / "hf"), arch, hidden_size=128,
                                  num_attention_heads=4, num_key_value_heads=2)
    actor = str(tmp_path / "actor")
    hf_to_mcore(hf_dir, actor, parallel=P())
    g = torch.Generator().manual_seed(0)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": torch.randint(
        1, 200, (3 + 2 * (i % 2),), generator=g).tolist()}) + "\n" for i in range(16)))
    replay = backend == "megatron"
    history = run(PPOConfig(
        actor=actor, prompts=str(prompts), algorithm="grpo", stop_token_ids=(),
        reward_fn="tests.ppo_tasks:low_token_fraction", nproc=2, steps=2, prompts_per_step=4,
        samples_per_prompt=2, max_new_tokens=8, ppo_epochs=2, mini_batches=2, actor_lr=3e-3,
        placement=placement, expert_parallel=ep, rollout_backend=backend,
        vllm_model_dir=hf_dir if backend == "vllm" else None, routing_replay=replay,
        sync_mode="delta" if placement == "disaggregated" else "full",
        out_dir=str(tmp_path / "run")))
    assert len(history) == 2
    for step in history:
        assert step["rollout/logprob_gap_max"] <= 2e-5, step
        assert step["actor/grad_norm"] > 0 and 1.0 <= step["actor/moe_load"] <= 2.0, step
        if replay:
            assert step["rollout/routing_replay_moved"] == 0.0, step
            assert 0 < step["actor/routing_replay_moved"] < 1, step
        else:
            assert "actor/routing_replay_moved" not in step
        if placement == "disaggregated":
            assert 0 < step["sync/sent_mib"] <= step["sync/full_mib"], step


def test_routing_replay_refuses_what_it_cannot_replay(moe, tiny):
    """A dense model has no router; full recomputation would route again in backward; a
    second registry on the same routers would silently take them from the first; a replay
    that leaves routings unused ran other micro-batches than were fed."""
    outs = launch_local(_replay_refusals, 1, moe, tiny)[0]
    assert "needs a mixture-of-experts model with experts in every layer" in outs["dense"]
    assert "recompute=full" in outs["full"]
    assert "already has a RoutingReplay" in outs["second"]
    assert "routings left unused" in outs["unused"]


def _replay_refusals(moe, tiny) -> dict:
    from megarlhf.models.gpt import build_model, model_spec
    from megarlhf.models.routing_replay import RoutingReplay
    from megarlhf.parallel.mesh import init_mesh

    mesh = init_mesh(P())
    build = lambda model, **kw: build_model(  # noqa: E731
        model_spec(model, P(), on_gpu=False, **kw), mesh, meta=True)
    out = {}
    full = RoutingReplay(build(moe, recompute="full"))
    chunks = build(moe)
    replay = RoutingReplay(chunks)
    for name, fn in (("dense", lambda: RoutingReplay(build(tiny))),
                     ("full", lambda: full.replay().__enter__()),
                     ("second", lambda: RoutingReplay(chunks))):
        try:
            fn()
        except ValueError as e:
            out[name] = str(e)
    try:
        with replay.replay():
            replay.feed(chunks[0], torch.zeros(1, moe.num_layers, 2, dtype=torch.long))
    except RuntimeError as e:
        out["unused"] = str(e)
    return out


# -- the rollout engine's routing replayed through the trainer's micro-batches -------------


def generate_with_routing(ckpt: str, prompts: list[list[int]], tp: int = 1) -> list:
    """The Megatron rollout engine at TP `tp` on the checkpoint's weights (through the weight
    bridge), asked for its routing; sampled, ragged (stop ids end some samples early)."""
    from megarlhf.engine.checkpoint import (
        checkpoint_architecture, engine_from_checkpoint, read_meta,
    )
    from megarlhf.models.gpt import model_spec
    from megarlhf.parallel.mesh import init_mesh
    from megarlhf.rollout.bridge import WeightBridge
    from megarlhf.rollout.engine import SamplingParams
    from megarlhf.rollout.megatron_engine import MegatronEngine, MegatronEngineConfig

    mesh = init_mesh(P(tensor_parallel=tp))
    trainer = engine_from_checkpoint(ckpt, P(tensor_parallel=tp), mesh, on_gpu=False)
    arch = checkpoint_architecture(read_meta(ckpt))
    engine = MegatronEngine(model_spec(trainer.spec.model, P(tensor_parallel=tp),
                                       on_gpu=False), mesh,
                            MegatronEngineConfig(architecture=arch.name, return_routing=True))
    engine.update_weights(WeightBridge(trainer.chunks, mesh, trainer.spec.model, arch).stream())
    params = SamplingParams(max_new_tokens=12, temperature=1.0, n=2, seed=3,
                            stop_token_ids=tuple(range(0, trainer.spec.model.vocab_size, 9)))
    return engine.generate(prompts, params)


def replayed_engine_routing(ckpt: str, parallel, batching, prompts, completions,
                            noise: float) -> dict:
    """The trainer at `parallel` scores the engine's completions: with its routers as the
    engine's, free and with the engine's routing replayed; and with `noise` added to the
    router weights, free and replayed. The log-probability gaps to the engine's, and which
    experts each pass used (read by a hook of the test's own, in the order the routers see
    tokens)."""
    from megatron.core.transformer.moe.router import TopKRouter

    from megarlhf.engine.checkpoint import engine_from_checkpoint
    from megarlhf.parallel.mesh import init_mesh
    from megarlhf.roles.policy import PolicyRole
    from megarlhf.rollout.experience import rollout_batch
    from megarlhf.rollout.gap import logprob_gap

    mesh = init_mesh(parallel)
    engine = engine_from_checkpoint(ckpt, parallel, mesh, on_gpu=False)
    actor = PolicyRole(engine, batching=batching)
    rollout = rollout_batch(prompts, completions)
    routers = [m for c in engine.unwrapped() for m in c.modules() if isinstance(m, TopKRouter)]
    used: list[torch.Tensor] = []
    for router in routers:
        router.register_forward_hook(lambda _m, _i, out: used.append(out[1].clone()))

    def scored(routing):
        used.clear()
        logp = actor.logprobs(rollout.sequences, routing=routing)
        gap = logprob_gap(rollout.engine_logp, logp, rollout.sequences.response_mask)
        return gap.max_abs, list(used)

    def same(a, b):
        return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))

    def moved_tokens(routes):  # per call, the tokens whose experts differ from free_used
        return [(x != y).any(1) for x, y in zip(routes, free_used, strict=True)]

    free, free_used = scored(None)
    replayed, replayed_used = scored(rollout.routing)
    g = torch.Generator().manual_seed(7)  # the same noise on every rank: replicated weights
    with torch.no_grad():
        for router in routers:
            router.weight.add_(noise * torch.randn(router.weight.shape, generator=g))
    drifted, drifted_used = scored(None)
    drifted_replayed, drifted_replayed_used = scored(rollout.routing)
    return {"free": free, "replayed": replayed, "drifted": drifted,
            "drifted_replayed": drifted_replayed, "calls": len(used),
            "moved": actor.routing_moved(),
            "same_routes": same(free_used, replayed_used),
            "drift_moved_routes": not same(free_used, drifted_used),
            # Tokens the engine routed take its experts again; the others (padding, a
            # response's last token) are the drifted router's own choice, as without replay.
            "replay_kept_routes": all(
                bool((kept & ~moved).sum() == 0) and int(kept.sum()) < int(moved.sum())
                for kept, moved in zip(moved_tokens(drifted_replayed_used),
                                       moved_tokens(drifted_used)) if moved.any())}


REPLAY_LAYOUTS = {
    # name: (trainer layout, ranks, micro-batching): packed rows under SP, count-mode rows
    # under CP and EP, token-budget padded rows over pipeline stages
    "tp2sp_packed": (P(tensor_parallel=2, sequence_parallel=True), 2,
                     {"max_tokens": 32, "pack": True}),
    "cp2_ep2": (P(context_parallel=2, expert_parallel=2), 2, {"num_microbatches": 2}),
    "pp2_budget": (P(pipeline_parallel=2), 2, {"max_tokens": 48}),
}


@pytest.fixture(scope="module")
def engine_rollout(moe_ref):
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(1, 200, (n,), generator=g).tolist() for n in (5, 2, 9, 4, 7, 3)]
    return prompts, launch_local(generate_with_routing, 1, moe_ref, prompts)[0]


def test_an_engine_at_tp2_returns_the_routing_of_tp1(moe_ref, engine_rollout):
    """Every TP rank of an engine routes all tokens (no sequence parallelism in generation):
    the same samples carry the same routing as at TP1, on both ranks."""
    prompts, tp1 = engine_rollout
    for tp2 in launch_local(generate_with_routing, 2, moe_ref, prompts, 2):
        assert [c.token_ids for c in tp2] == [c.token_ids for c in tp1]
        assert all(torch.equal(a.routing, b.routing) for a, b in zip(tp2, tp1))


@pytest.mark.parametrize("layout", list(REPLAY_LAYOUTS))
def test_engine_routing_replays_in_the_trainer(moe_ref, engine_rollout, layout):
    """The Megatron engine's routing (prefill, then one token per decode step, samples
    leaving the batch as they stop) reaches the trainer's routers through rollout_batch and
    the micro-batches (left-padded rows, packed rows, CP and SP slices, pipeline stages):
    - on the engine's own weights, replaying changes no token's experts (hook) and the
      logprob gap stays at the fp32 level (<= 1e-5, as test_rollout_matrix);
    - with noise 1e-4 on the trainer's router weights (std 0.02) tokens near a tie move to
      other experts and the free gap grows to >= 1e-3 (measured 1.8e-3); replayed, the
      tokens the engine routed take its experts again (hook: fewer tokens off their
      undrifted experts, and no new ones), the replay reports the moved share,
      and what is left is the drift's first-order effect on the routing weights: <= 2e-5
      (measured 9e-6, twice the fp32 tolerance) and 100x below the free gap.
    A routing fed in any other token order sends tokens to other experts: the routes would
    differ and the replayed gap would be of the free drifted gap's size or larger (measured
    1.2e-2 at TP1 with the sequence-major transpose left out)."""
    from megarlhf.roles.batching import Batching

    prompts, completions = engine_rollout
    assert len({len(c.token_ids) for c in completions}) > 1  # ragged: samples stopped early
    parallel, nprocs, batching = REPLAY_LAYOUTS[layout]
    outs = launch_local(replayed_engine_routing, nprocs, moe_ref, parallel, Batching(**batching),
                        prompts, completions, 1e-4)
    # on the ranks whose tokens (CP) or layers (PP) hold a tie
    assert any(out["drift_moved_routes"] for out in outs)
    for out in outs:
        assert out["calls"] > 0 and out["same_routes"] and out["replay_kept_routes"], out
        assert out["free"] <= 1e-5 and out["replayed"] <= 1e-5, out
        assert 0 < out["moved"] < 0.1, out
        assert out["drifted"] >= 1e-3, out
        assert out["drifted_replayed"] <= 2e-5, out
        assert out["drifted_replayed"] * 100 <= out["drifted"], out
