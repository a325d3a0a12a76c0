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
    """PPO with a mixture-of-experts actor, reference and critic (value head on the MoE
    trunk), disaggregated with a Megatron rollout rank (the same engine and samples for any
    trainer layout): every role at EP2 (each rank half the experts) against EP1, both DP2.
    Tolerance as the CP one's (tests/test_ppo.py): rel 1e-5, abs 1e-6 near 0."""
    from megarlhf.ppo.config import PPOConfig
    from megarlhf.ppo.controller import run
    from megarlhf.ppo.layout import group_specs
    from tests.test_ppo import _without_timings

    critic = str(tmp_path / "critic")
    launch_local(workers.write_reference, 1, critic, moe, 1, True)
    g = torch.Generator().manual_seed(0)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": torch.randint(
        1, 300, (3 + 2 * (i % 2),), generator=g).tolist()}) + "\n" for i in range(16)))
    base = PPOConfig(actor=moe_ref, critic=critic, prompts=str(prompts),
                     reward_fn="tests.ppo_tasks:low_token_fraction", nproc=2, steps=2,
                     prompts_per_step=4, samples_per_prompt=2, max_new_tokens=8, ppo_epochs=2,
                     mini_batches=2, actor_lr=3e-3, critic_lr=1e-3, kl_coef=0.01,
                     placement="disaggregated", out_dir=str(tmp_path / "ep1"))
    ep1 = run(base)
    config = dataclasses.replace(base, out_dir=str(tmp_path / "ep2"), expert_parallel=2)
    assert [(g.name, g.parallel.expert_parallel) for g in group_specs(config)] == [
        ("actor", 2), ("critic", 2), ("ref", 2), ("rollout", 1)]
    ep2 = run(config)
    for step, (ours, theirs) in enumerate(zip(ep2, ep1), start=1):
        strip = {k: v for k, v in _without_timings(theirs).items()
                 if not k.startswith("memory/")}  # bytes per rank: the layouts differ
        strip = {k: v for k, v in strip.items() if not k.endswith("/moe_load")}  # EP1: 1.0
        assert {k: ours[k] for k in strip} == pytest.approx(strip, rel=1e-5, abs=1e-6), step
        assert theirs["actor/moe_load"] == 1.0 and 1.0 <= ours["actor/moe_load"] <= 2.0
    assert len(ep2) == 2 and ep2[-1]["actor/grad_norm"] > 0 and ep2[-1]["critic/grad_norm"] > 0


def replayed_gaps(ckpt: str, model, parallel, batch: dict, noise: float) -> dict:
    """Log-probabilities of a model (the engine's stand-in, recording its routing) against the
    same model with `noise` added to every router weight (the trainer's, drifted), without
    and with the recorded routing replayed; and which experts each pass used, read from the
    routers' outputs by a hook of the test's own."""
    from megatron.core.transformer.moe.router import TopKRouter

    from megarlhf.engine.checkpoint import engine_from_checkpoint
    from megarlhf.engine.losses import gather_logits
    from megarlhf.engine.schedule import gather_rows, rank_microbatches
    from megarlhf.models.routing_replay import RoutingReplay
    from megarlhf.parallel.mesh import init_mesh

    mesh = init_mesh(parallel)
    engine = engine_from_checkpoint(ckpt, parallel, mesh, on_gpu=False)
    replay = RoutingReplay(engine.unwrapped())
    routers = [m for c in engine.unwrapped() for m in c.modules() if isinstance(m, TopKRouter)]
    used: list[torch.Tensor] = []
    for router in routers:
        router.register_forward_hook(lambda _m, _i, out: used.append(out[1].clone()))

    def logprobs():
        def keep(mb, out):
            logits = gather_logits(out, mesh, model.vocab_size).float()
            return torch.zeros(()), torch.ones((), dtype=torch.int), {
                "out": torch.log_softmax(logits, dim=-1).detach()}
        used.clear()
        out = engine.forward(rank_microbatches(batch, mesh, 2), keep)
        return gather_rows(out, "out", mesh), list(used)

    with replay.record():
        reference, reference_used = logprobs()
    recorded = replay.recorded()
    g = torch.Generator().manual_seed(7)  # the same noise on every rank: replicated weights
    with torch.no_grad():
        for router in routers:
            router.weight.add_(noise * torch.randn(router.weight.shape, generator=g))
    free, free_used = logprobs()
    with replay.replay(recorded):
        replayed, replayed_used = logprobs()
    return {"calls": {k: len(v) for k, v in recorded.items()},
            "free": (free - reference).abs().max().item(),
            "replayed": (replayed - reference).abs().max().item(),
            "routes_moved": any(not torch.equal(a, b)
                                for a, b in zip(free_used, reference_used)),
            "replayed_routes_equal": len(replayed_used) == len(reference_used) and all(
                torch.equal(a, b) for a, b in zip(replayed_used, reference_used))}


@pytest.mark.parametrize("layout", ["ep1", "ep2"])
def test_routing_replay_removes_the_gap_a_drifted_router_makes(moe, moe_ref, layout):
    """The trainer's routers drift from the engine's by noise of std 1e-4 on their weights
    (std 0.02): small, but enough to move tokens near a tie to other experts. Without replay
    the log-probabilities move by those routing decisions (>= 1e-3); with the engine's
    routing replayed every router uses exactly the recorded experts, and what is left is the
    drift's first-order effect on the routing weights: within 2e-5 (measured 1.4e-5), twice
    the trainer-vs-engine tolerance of the dense models in test_rollout_matrix.py, and at
    least 100x below the gap without replay."""
    parallel, nprocs = (P(), 1) if layout == "ep1" else (P(expert_parallel=2), 2)
    batch = workers.make_batch(moe, batch=4, seq=16, seed=5)
    outs = launch_local(replayed_gaps, nprocs, moe_ref, moe, parallel, batch, 1e-4)
    assert any(out["routes_moved"] for out in outs)  # on the rank whose rows hold the tie
    for out in outs:
        assert set(out["calls"].values()) == {2}  # one routing per micro-batch per layer
        assert out["replayed_routes_equal"], out
        assert out["free"] >= 1e-3, out
        assert out["replayed"] <= 2e-5 and out["replayed"] * 100 <= out["free"], out


def test_routing_replay_refuses_what_it_cannot_replay(moe, tiny):
    """A dense model has no router; full recomputation would route again in backward; a
    replay that leaves recorded routings unused ran other micro-batches than were recorded."""
    outs = launch_local(_replay_refusals, 1, moe, tiny)[0]
    assert "needs a mixture-of-experts model" in outs["dense"]
    assert "recompute=full" in outs["full"]
    assert "routings left unused" in outs["unused"]


def _replay_refusals(moe, tiny) -> dict:
    from megarlhf.models.gpt import build_model, model_spec
    from megarlhf.models.routing_replay import RoutingReplay
    from megarlhf.parallel.mesh import init_mesh

    mesh = init_mesh(P())
    out = {}
    for name, model, recompute in (("dense", tiny, "none"), ("full", moe, "full")):
        try:
            RoutingReplay(build_model(model_spec(model, P(), on_gpu=False,
                                                 recompute=recompute), mesh, meta=True))
        except ValueError as e:
            out[name] = str(e)
    replay = RoutingReplay(build_model(model_spec(moe, P(), on_gpu=False), mesh, meta=True))
    try:
        with replay.replay({k: [torch.zeros(1, 2, dtype=torch.long)] for k in replay.slots}):
            pass
    except RuntimeError as e:
        out["unused"] = str(e)
    return out
