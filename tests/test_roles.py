"""PPO roles across the mesh: one actor + critic update at TP2xPP2xDP2 with sequence
parallelism and activation recomputation, with 4 micro-batches, and with token-budget
micro-batches packed at TP2 and PP2 and padded at PP2, equals TP1 with 1 padded micro-batch;
reward scores under PP2 with padding or packing equal an unpadded TP1 forward; and the batch
checks.

Tolerances: 1e-5 (abs on logprobs/values/weights, rel on losses). Layouts differ only in fp32
summation order (~1e-7 here); one Adam step at lr 1e-3 moves weights by ~1e-3, so a wrong
gradient (a micro-batch normalised twice, a DP rank missing) shows as >= 1e-4. Sequence
parallelism (norms and the value head on sequence slices, reduce-scatter instead of
all-reduce) and recomputation (the same forward run again in backward) change only that order
too: measured 4.8e-7 on logprobs, 9.5e-7 after the step, 4.1e-7 on weights, 1.4e-7 relative
on grad norms.
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from megarlhf.data.packing import document_mask
from megarlhf.data.sequences import SequenceBatch
from megarlhf.parallel import launch_local
from megarlhf.parallel.mesh import ParallelConfig as P
from megarlhf.roles.policy import PolicyLossConfig, ptx_scale
from megarlhf.roles.batching import Batching
from tests import role_workers
from tests.grouping import grouped_launches, selected_ids

TOL = 1e-5
VOCAB = 300  # the tiny preset's


def test_sequence_batch_positions_and_mask():
    batch = SequenceBatch(tokens=torch.tensor([[0, 5, 6, 7, 0]]),
                          attention_mask=torch.tensor([[0, 1, 1, 1, 0]]),
                          response_mask=torch.tensor([[0, 0, 0, 1, 0]]))
    assert batch.position_ids().tolist() == [[0, 0, 1, 2, 2]]
    allowed = ~document_mask(batch.document_ids())[0, 0]
    assert allowed[3].tolist() == [False, True, True, True, False]  # causal, no padding keys
    assert allowed[0].tolist() == [True, False, False, False, False]  # padding sees itself
    # Sequence parallelism's padding: masked columns no real token sees; the last real
    # token and every real column's inputs unchanged.
    padded = batch.right_padded(3)
    assert padded.shape == (1, 8) and padded.response_mask[0, 5:].tolist() == [0, 0, 0]
    inputs, ours = padded.model_inputs(), batch.model_inputs()
    assert torch.equal(inputs["position_ids"][:, :5], ours["position_ids"])
    mask, ours_mask = document_mask(inputs["document_ids"]), document_mask(ours["document_ids"])
    assert torch.equal(mask[..., :5, :5], ours_mask)
    assert mask[0, 0, :5, 5:].all()  # real rows never see padding
    # The rows of some queries only (a context-parallel rank's): those rows of the whole.
    rows = torch.tensor([0, 3, 6])
    assert torch.equal(document_mask(inputs["document_ids"], rows), mask[:, :, rows])


@pytest.mark.parametrize("change,match", [
    (dict(response_mask=torch.zeros(2, 4, dtype=torch.long)), r"rows \[0, 1\] have an empty"),
    (dict(attention_mask=torch.ones(2, 5, dtype=torch.long)), r"attention_mask has shape"),
    (dict(response_mask=torch.tensor([[1, 0, 0, 0], [0, 0, 1, 0]])), r"rows \[0\] .*column 0"),
    # A left-padded row whose response starts at its first real token.
    (dict(attention_mask=torch.tensor([[1, 1, 1, 0], [0, 1, 1, 1]]),
          response_mask=torch.tensor([[0, 0, 1, 0], [0, 1, 1, 0]])),
     r"rows \[1\] have a response token at their first real token"),
    (dict(response_mask=torch.tensor([[0, 0, 0, 1], [0, 0, 1, 1]])), "padding positions"),
    (dict(tokens=torch.ones(2, 4)), "integer tensor"),
])
def test_sequence_batch_rejects_bad_input(change, match):
    fields = dict(tokens=torch.ones(2, 4, dtype=torch.long),
                  attention_mask=torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]]),
                  response_mask=torch.tensor([[0, 0, 1, 0], [0, 0, 1, 1]]))
    with pytest.raises(ValueError, match=match):
        SequenceBatch(**{**fields, **change})


def test_sequences_longer_than_the_model_allows_are_refused():
    batch = role_workers.experience_batch(300, rows=1, seed=0)
    with pytest.raises(ValueError, match="18 tokens long, more than the model's "
                                         "max_position_embeddings=16"):
        batch.check_length(16)


def test_ptx_scale_and_its_checks():
    batch = role_workers.experience_batch(VOCAB, rows=4, seed=0)
    ptx = role_workers.experience_batch(VOCAB, rows=4, seed=1)
    for mode, ppo_den in (("token_mean", int(batch.response_mask.sum())),
                          ("seq_mean_token_mean", 4)):
        cfg = PolicyLossConfig(ptx_coef=0.5, aggregation=mode)
        assert ptx_scale(cfg, batch.response_mask, ptx) == pytest.approx(
            0.5 * ppo_den / int(ptx.response_mask.sum()))
    assert ptx_scale(PolicyLossConfig(), batch.response_mask, None) == 0.0
    with pytest.raises(ValueError, match="go together"):
        ptx_scale(PolicyLossConfig(), batch.response_mask, ptx)
    with pytest.raises(ValueError, match="go together"):
        ptx_scale(PolicyLossConfig(ptx_coef=1.0), batch.response_mask, None)
    with pytest.raises(ValueError, match="ptx_coef must be >= 0"):
        PolicyLossConfig(ptx_coef=-1.0)


@pytest.fixture(scope="module")
def refs(lm_ref, value_refs):
    return lm_ref, value_refs[True][1]


@pytest.fixture(scope="module")
def ppo_batch(tiny):
    # T = 17, odd: under sequence parallelism at TP2 the roles pad it to 18 and cut it back.
    # Two samples per prompt: layouts with shared prompts run each prompt once.
    return role_workers.experience_batch(tiny.vocab_size, rows=8, seed=3, columns=17,
                                         samples=2)


@pytest.fixture(scope="module")
def ppo_reference(refs, ppo_batch, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ppo_tp1"))
    result = launch_local(role_workers.ppo_step, 1, *refs, P(), ppo_batch, Batching(), out)[0]
    return result, out


def _compare(result, ref, out_dir, ref_dir):
    for role in ("actor", "critic"):
        for key, value in ref[role].items():
            if key == "positions_per_token":  # what the layouts differ in
                continue
            assert result[role][key] == pytest.approx(value, rel=TOL, abs=1e-9), f"{role} {key}"
    for key in ("logp", "entropy", "values", "logp_after", "values_after"):
        torch.testing.assert_close(result[key], ref[key], atol=TOL, rtol=0, msg=key)
    for role in ("actor", "critic"):
        ours = role_workers.checkpoint_tensors(f"{out_dir}/{role}")
        theirs = role_workers.checkpoint_tensors(f"{ref_dir}/{role}")
        assert ours.keys() == theirs.keys()
        for key in ours:
            a, b = ours[key], theirs[key]
            if key in ("embedding.word_embeddings.weight", "output_layer.weight"):
                a, b = a[:VOCAB], b[:VOCAB]  # padding rows differ in number between TP sizes
            diff = (a.float() - b.float()).abs()
            assert diff.max() <= TOL, f"{role} {key}: max |diff| {diff.max():.3e} at " \
                                      f"{(diff == diff.max()).nonzero()[0].tolist()}"


@pytest.mark.slow
def test_reference_step_is_meaningful(ppo_reference):
    ref, _ = ppo_reference
    assert 0.05 < ref["actor"]["clip_fraction"] < 0.95
    actor = ref["actor"]  # token-mean mode: the step's loss is PPO - entropy bonus + ptx
    assert actor["loss"] == pytest.approx(actor["policy_loss"] - 0.01 * actor["entropy"]
                                          + 0.5 * actor["ptx_loss"], rel=1e-6)
    assert actor["ptx_loss"] > 1.0  # an untrained model's NLL on random tokens
    assert ref["critic"]["value_clip_fraction"] > 0
    assert (ref["logp_after"] - ref["logp"]).abs().max() > 1e-3  # the step moved the actor
    assert (ref["values_after"] - ref["values"]).abs().max() > 1e-3


STEP_LAYOUTS = {
    # Sequence parallelism on a mesh without it (as in a PPO worker), across pipeline stages
    # (the p2p shapes are the padded sequence over TP); the actor recomputes whole layers in
    # backward, the critic its core attention. Without them, TP2xPP2xDP2 training is
    # tests/test_parallel_equivalence.py's and the roles at TP2xDP2 the policy-terms test's
    # below: the roles add nothing to a layout but this padding. Shared prompts: each
    # micro-batch's two samples of a prompt run as one model row (the ptx micro-batches'
    # rows, of different prompts, as one each: the stages exchange the shapes), every
    # pipeline stage rotating by the layout's columns, recomputed layers too.
    "TP2xPP2xDP2+SP+recompute+shared-prompts": (P(tensor_parallel=2, pipeline_parallel=2,
                                                  sequence_parallel=True), 8,
                                                Batching(2, share_prompts=True),
                                                ("full", "selective")),
    "TP1x4microbatches": (P(), 1, Batching(4), ("none", "none")),
    # Shared prompts under a token budget: a prompt's two samples in one model row, the
    # budget counting the layout's positions; at TP1, and across pipeline stages under
    # TP + SP (micro-batches of different shapes, the ptx rows' budget micro-batches too).
    "TP1+token-budget-shared": (P(), 1, Batching(max_tokens=40, share_prompts=True),
                                ("none", "none")),
    "TP2xPP2+SP+token-budget-shared": (P(tensor_parallel=2, pipeline_parallel=2,
                                         sequence_parallel=True), 4,
                                       Batching(max_tokens=40, share_prompts=True),
                                       ("none", "none")),
    # Token budgets: rows of 4-17 tokens (and as many ptx rows), so each DP rank runs 5-8
    # micro-batches of different shapes. Packed under sequence parallelism (packed rows
    # padded to a multiple of TP) and across pipeline stages (the stages exchange each
    # micro-batch's shape); padded across pipeline stages, where the two DP ranks run 6 and 8
    # micro-batches (ranks meet only in the gradient reduction).
    "TP2xDP2+SP+packed": (P(tensor_parallel=2, sequence_parallel=True), 4,
                          Batching(max_tokens=24, pack=True), ("none", "none")),
    "PP2xDP2+packed": (P(pipeline_parallel=2), 4, Batching(max_tokens=24, pack=True),
                       ("none", "none")),
    "PP2xDP2+token-budget-padded": (P(pipeline_parallel=2), 4, Batching(max_tokens=24),
                                    ("none", "none")),
    # Context parallelism: rows padded to a multiple of 2 x CP (x TP under SP); every role's
    # outputs gathered to whole rows. Count mode over DP, a packed budget under TP + SP, a
    # padded budget across pipeline stages with full recomputation.
    "CP2xDP2": (P(context_parallel=2), 4, Batching(2), ("none", "none")),
    "TP2xCP2+SP+packed": (P(tensor_parallel=2, sequence_parallel=True, context_parallel=2), 4,
                          Batching(max_tokens=24, pack=True), ("selective", "none")),
    "PP2xCP2+token-budget-padded+recompute": (P(pipeline_parallel=2, context_parallel=2), 4,
                                              Batching(max_tokens=24), ("full", "none")),
}


# Old logprobs from the update pass itself, over pipeline stages (the outputs reach every
# stage) and DP ranks that run different numbers of micro-batches (token budgets), with ptx
# micro-batches after the PPO ones.
ONE_PASS_LAYOUT = (P(pipeline_parallel=2), 4, Batching(max_tokens=24))


@pytest.fixture(scope="module")
def role_launches(request, refs, ppo_batch, tmp_path_factory):
    """Each layout's (per-rank results, out dir), and the one-pass update's per-rank results
    as "one_pass"; the selected cases of one process count run in one launch."""
    outs = {name: str(tmp_path_factory.mktemp("ppo")) for name in STEP_LAYOUTS}
    cases = {name: (nprocs, role_workers.ppo_step, (*refs, parallel, ppo_batch, batching,
                                                    outs[name]), {"recompute": recompute})
             for name, (parallel, nprocs, batching, recompute) in STEP_LAYOUTS.items()}
    parallel, nprocs, batching = ONE_PASS_LAYOUT
    cases["one_pass"] = (nprocs, role_workers.one_pass_update,
                         (refs[0], parallel, ppo_batch, batching), {})
    wanted = selected_ids(request, "test_ppo_step_equals_tp1") | (
        {"one_pass"} if any(item.name == "test_update_pass_old_logprobs_equal_a_separate_pass"
                            for item in request.session.items) else set())
    results = grouped_launches(cases, wanted)
    return lambda name: (results(name), outs.get(name))


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(STEP_LAYOUTS))
def test_ppo_step_equals_tp1(layout, role_launches, ppo_reference):
    ref, ref_dir = ppo_reference
    results, out = role_launches(layout)
    for result in results:
        _compare(result, ref, out, ref_dir)
        if "shared" in layout:  # what sharing exists for: fewer model positions than
            # real tokens (a row per sample, even unpadded, runs one per real token)
            assert result["actor"]["positions_per_token"] < 1, layout


@pytest.mark.slow
def test_update_pass_old_logprobs_equal_a_separate_pass(role_launches):
    """One update per batch: the update pass's own logprobs (detached) as the old ones give
    the step a separate pass gives. What the pass hands its check equals the separate pass's
    logprobs and entropy (fp32; the same forward in train and eval mode, no dropout: 1e-6);
    a refused check leaves the weights bitwise as they were; the accepted step's metrics and
    the logprobs after it equal the separate-pass step's (the ratios differ from 1 by ~1e-7:
    TOL)."""
    results, _ = role_launches("one_pass")
    for r in results:
        assert r["refused_skipped"] and len(r["checked"]) == 2
        for logp, entropy in r["checked"]:
            torch.testing.assert_close(logp, r["logp"], atol=1e-6, rtol=0)
            torch.testing.assert_close(entropy, r["entropy"], atol=1e-6, rtol=0)
        assert torch.equal(r["unmoved"], r["logp"])
        assert r["one_pass"]["clip_fraction"] == 0 and r["one_pass"]["ptx_loss"] > 1.0
        for key, value in r["separate"].items():
            assert r["one_pass"][key] == pytest.approx(value, rel=TOL, abs=1e-9), key
        torch.testing.assert_close(r["one_pass_after"], r["separate_after"], atol=TOL, rtol=0)
        assert (r["one_pass_after"] - r["logp"]).abs().max() > 1e-3  # the step moved


@pytest.mark.slow
def test_the_lm_head_runs_only_where_response_tokens_read_it(refs, ppo_batch):
    """Logprobs and entropy at the response tokens with the LM head cut to the positions
    before them equal those from logits everywhere (fp32; the same matmuls on fewer rows:
    1e-6), 0 elsewhere; at TP2 + SP, where the decoder's output is gathered over the
    sequence-parallel ranks before the cut. The head's rows shrink to what the response
    tokens need: one position per response token (packed), the columns they span (rows)."""
    batchings = {"rows": Batching(2), "packed": Batching(max_tokens=24, pack=True)}
    results = launch_local(role_workers.logprobs_with_and_without_the_cut, 2, refs[0],
                           P(tensor_parallel=2, sequence_parallel=True), ppo_batch, batchings)
    response = ppo_batch.response_mask.bool()
    # Batched rows (count mode: 2 micro-batches of 4 rows, full width): each micro-batch's
    # rows times the columns before its response tokens.
    needed_columns = sum(4 * len({c - 1 for c in response[rows].nonzero()[:, 1].tolist()})
                         for rows in (slice(0, 4), slice(4, 8)))
    for name, batching in batchings.items():
        for rank in results:
            r = rank[name]
            for cut, whole in zip(r["cut"], r["whole"]):
                torch.testing.assert_close(cut[response], whole[response], atol=1e-6, rtol=0)
                assert not cut[~response].any()
            if r["pp_last"]:
                # Uncut, each of the 2 sequence-parallel ranks feeds the head its half of
                # the positions (the head gathers them); cut, the gathered positions needed.
                whole = 2 * r["head_rows_whole"]
                assert whole >= ppo_batch.attention_mask.sum()
                expected = int(response.sum()) if batching.pack else needed_columns
                assert r["head_rows_cut"] == expected, (name, r)


@pytest.mark.slow
def test_reward_scores_under_pp2_with_padding_equal_unpadded_tp1(value_refs, ppo_batch):
    ckpt = value_refs[True][1]
    alone = launch_local(role_workers.unpadded_scores, 1, ckpt, ppo_batch)[0]
    for parallel, nprocs, batching in (
            (P(pipeline_parallel=2), 2, Batching(2)),
            (P(tensor_parallel=2, pipeline_parallel=2), 4, Batching(2)),
            (P(pipeline_parallel=2), 2, Batching(max_tokens=24, pack=True))):
        scores = launch_local(role_workers.reward_scores, nprocs, ckpt, parallel, ppo_batch,
                              batching)[0]
        torch.testing.assert_close(scores, torch.tensor(alone), atol=TOL, rtol=0)


# Loss options of the RL algorithms (megarlhf/ppo/algorithms.py), each with a KL loss and
# rollout-correction weights: GSPO's sequence ratio with Dr. GRPO's constant normaliser, and
# CISPO with per-row sums. Clip ranges chosen so that both clip branches are taken.
POLICY_OPTIONS = {
    "gspo_sum_norm": PolicyLossConfig(clip_eps=0.02, clip_eps_high=0.03, ratio_level="sequence",
                                      aggregation="seq_mean_token_sum_norm",
                                      aggregation_norm=10, kl_estimator="k3"),
    "cispo_seq_sum": PolicyLossConfig(clip_eps=1.0, clip_eps_high=0.05, kind="cispo",
                                      aggregation="seq_mean_token_sum", kl_estimator="k2"),
}


def _reference_terms(r: dict, cfg: PolicyLossConfig) -> dict[str, float]:
    """Policy and KL loss of one update from its inputs, in Python floats (one row's
    advantage per row, as the worker makes them)."""
    rows_pg, rows_kl, clipped, tokens = [], [], 0, 0
    for lp, old, adv, ref, w, m in zip(*(r[k].double().tolist() for k in (
            "logp", "old_logp", "advantages", "ref_logp", "is_weight")),
            r["response_mask"].tolist()):
        ts = [t for t, keep in enumerate(m) if keep]
        if cfg.ratio_level == "sequence":
            ratios = [math.exp(statistics.fmean(lp[t] - old[t] for t in ts))] * len(ts)
        else:
            ratios = [math.exp(lp[t] - old[t]) for t in ts]
        pg = []
        for t, ratio in zip(ts, ratios):
            bounded = min(max(ratio, 1 - cfg.clip_eps), 1 + cfg.clip_eps_high)
            a = adv[t]
            loss = (-a * bounded if cfg.kind == "cispo" else max(-a * ratio, -a * bounded))
            clipped += (bounded != ratio) if cfg.kind == "cispo" else (-a * bounded > -a * ratio)
            pg.append(loss * w[t])
        x = [lp[t] - ref[t] for t in ts]
        rows_kl.append([math.exp(-d) - 1 + d if cfg.kl_estimator == "k3" else 0.5 * d * d
                        for d in x])
        rows_pg.append(pg)
        tokens += len(ts)
    norm = cfg.aggregation_norm or 1.0
    agg = lambda rows: sum(map(sum, rows)) / norm / len(rows)  # noqa: E731 (per-row sums)
    return {"policy_loss": agg(rows_pg), "kl_loss": agg(rows_kl),
            "clip_fraction": clipped / tokens}


def test_a_failed_sample_carries_no_loss(refs, ppo_batch):
    """Rows 1, 2 and 5 out of the loss mask (their advantages +1e3, returns -1e3): the actor's
    and the critic's steps equal those on the batch that never had them (grad norms, and the
    logprobs and values after the step). Tolerance 1e-6: the same sums over other batch
    shapes, fp32."""
    result = launch_local(role_workers.masked_rows_update, 1, *refs, ppo_batch, [1, 2, 5])[0]
    masked, without = result["masked"], result["without"]
    for key in ("actor_grad_norm", "critic_grad_norm"):
        assert masked[key] == pytest.approx(without[key], rel=1e-6), key
    for key in ("logp_after", "values_after"):
        torch.testing.assert_close(masked[key], without[key], atol=1e-6, rtol=0, msg=key)


@pytest.fixture(scope="module", params=sorted(POLICY_OPTIONS))
def policy_reference(request, refs, ppo_batch):
    cfg = POLICY_OPTIONS[request.param]
    result = launch_local(role_workers.policy_terms, 1, refs[0], P(), ppo_batch, Batching(),
                          cfg)[0]
    return cfg, {**result, "response_mask": ppo_batch.response_mask}


@pytest.mark.slow
def test_policy_loss_terms_are_their_formulas(policy_reference):
    cfg, result = policy_reference
    m, want = result["metrics"], _reference_terms(result, cfg)
    # fp32 logprobs in the model, float64 here: ~1e-7 relative.
    for key, value in want.items():
        assert m[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
    assert 0 < m["clip_fraction"] < 1 and m["kl_loss"] > 0.01
    assert m["loss"] == pytest.approx(m["policy_loss"] + 0.1 * m["kl_loss"], rel=1e-5)


@pytest.mark.slow
def test_policy_loss_terms_at_tp2_dp2_with_micro_batches_equal_tp1(refs, ppo_batch,
                                                                   policy_reference):
    cfg, ref = policy_reference
    # GSPO's sequence ratios and per-row sums from packed rows (the loss sees each sequence
    # unpacked); CISPO from two padded micro-batches per rank.
    batching = Batching(max_tokens=24, pack=True) if cfg.ratio_level == "sequence" \
        else Batching(2)
    for result in launch_local(role_workers.policy_terms, 4, refs[0], P(tensor_parallel=2),
                               ppo_batch, batching, cfg):
        for key, value in ref["metrics"].items():
            if key == "positions_per_token":  # what the layouts differ in
                continue
            assert result["metrics"][key] == pytest.approx(value, rel=TOL, abs=1e-9), key
        torch.testing.assert_close(result["logp_after"], ref["logp_after"], atol=TOL, rtol=0)
