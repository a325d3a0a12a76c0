"""The algorithm options (GSPO's sequence ratio, CISPO, the KL clamp, the rollout correction,
DAPO's overlong penalty and group filter, in-reward KL for group estimators) against direct
Python loops over each formula as its paper or peer implementation states it, and the
presets against the values those name.

Tolerance: as tests/test_rl_math.py, float64 on both sides, 1e-10 (summation order only).
Gradients are checked too where an option is about the gradient (GSPO's and CISPO's point).
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from megarlhf.models.lora import LoraConfig
from megarlhf.ppo.algorithms import PRESETS, resolve
from megarlhf.ppo.config import Layout, RoleLayout
from megarlhf.rl import aggregate, kl_penalty, policy_loss
from megarlhf.rl.correction import rollout_correction
from megarlhf.rl.shaping import overlong_penalty, varied_groups
from tests.test_rl_math import B, SPANS, T, TOL, lists, make_mask, rand, ref_kl, tensor


def _ratio_inputs(seed: int, scale: float = 1.0):
    old = rand(B, T, seed=seed, scale=0.5) - 2.0
    logp = (old + rand(B, T, seed=seed + 1, scale=scale)).requires_grad_()
    adv = rand(B, seed=seed + 2).unsqueeze(-1).expand(B, T).contiguous()  # one per row
    return logp, old, adv, make_mask()


# --- GSPO: sequence-level ratio -------------------------------------------------------------

@pytest.mark.parametrize("eps_low,eps_high", [(0.2, 0.2), (3e-4, 4e-4)])
def test_sequence_ratio_is_gspo_in_value_and_gradient(eps_low, eps_high):
    """GSPO (Zheng et al. 2025, eq. 5-7): s_i = exp(mean_t log(pi/pi_old)),
    J_i = min(s_i A_i, clip(s_i) A_i); the gradient of -mean_i J_i in logp_t is
    -A_i s_i / |y_i| / B' where unclipped, 0 where clipped (B' rows)."""
    logp, old, adv, mask = _ratio_inputs(seed=30, scale=0.05 if eps_low < 0.1 else 0.5)
    loss_BT, stats = policy_loss(logp, old, adv, mask, clip_eps=eps_low,
                                 clip_eps_high=eps_high, ratio_level="sequence")
    num, den = aggregate(loss_BT, mask, "seq_mean_token_mean")
    (grad,) = torch.autograd.grad(num / den, logp)
    want_loss, want_grad, clipped_rows = [], [], 0
    for lp, o, a, (s, e) in zip(lists(logp.detach()), lists(old), lists(adv), SPANS):
        a = a[s]
        ratio = math.exp(statistics.fmean(lp[t] - o[t] for t in range(s, e)))
        bounded = min(max(ratio, 1 - eps_low), 1 + eps_high)
        j = min(ratio * a, bounded * a)
        clipped = bounded * a < ratio * a
        clipped_rows += clipped
        g = 0.0 if clipped else -a * ratio / (e - s) / B
        want_loss.append([-j if s <= t < e else 0.0 for t in range(T)])
        want_grad.append([g if s <= t < e else 0.0 for t in range(T)])
    torch.testing.assert_close(loss_BT.detach(), tensor(want_loss), **TOL)
    torch.testing.assert_close(grad, tensor(want_grad), **TOL)
    assert 0 < clipped_rows < B  # both branches taken
    assert stats["clipped"].sum(dim=-1).bool().sum() == clipped_rows


# --- CISPO ----------------------------------------------------------------------------------

def test_cispo_weights_the_reinforce_term_and_keeps_clipped_gradients():
    """MiniMax-M1's CISPO: J = sum_t sg(clip(r_t, 1 - eps_low, 1 + eps_high)) A_t log pi(y_t):
    loss value -A * clipped r, gradient -A * clipped r in logp_t, also where r is clipped."""
    logp, old, adv, mask = _ratio_inputs(seed=40, scale=0.5)
    loss_BT, stats = policy_loss(logp, old, adv, mask, clip_eps=1.0, clip_eps_high=0.2,
                                 kind="cispo")
    num, den = aggregate(loss_BT, mask, "token_mean")
    (grad,) = torch.autograd.grad(num / den, logp)
    tokens = sum(e - s for s, e in SPANS)
    want_loss, want_grad, clipped = [], [], 0
    for lp, o, a, m in zip(lists(logp.detach()), lists(old), lists(adv), lists(mask)):
        row_loss, row_grad = [], []
        for x, y, adv_t, keep in zip(lp, o, a, m):
            weight = min(math.exp(x - y), 1.2)  # no lower bound (clip_eps 1)
            clipped += bool(keep) and weight < math.exp(x - y)
            row_loss.append(-adv_t * weight if keep else 0.0)
            row_grad.append(-adv_t * weight / tokens if keep else 0.0)
        want_loss.append(row_loss)
        want_grad.append(row_grad)
    torch.testing.assert_close(loss_BT.detach(), tensor(want_loss), **TOL)
    torch.testing.assert_close(grad, tensor(want_grad), **TOL)
    assert clipped > 0 and stats["clipped"].sum() == clipped
    assert (grad[stats["clipped"].bool()] != 0).all()  # clipped tokens keep their gradient


def test_log_ratio_clamp_bounds_the_ratio():
    logp, old, adv, mask = _ratio_inputs(seed=50, scale=30.0)  # ratios up to e^90
    loss_BT, _ = policy_loss(logp, old, adv, mask, clip_eps=0.2, log_ratio_clamp=20.0)
    want = [[(ref_clamped_loss(x, y, a, 20.0) if m else 0.0) for x, y, a, m in zip(*r)]
            for r in zip(lists(logp.detach()), lists(old), lists(adv), lists(mask))]
    torch.testing.assert_close(loss_BT.detach(), tensor(want), **TOL)
    assert torch.isfinite(loss_BT).all()


def ref_clamped_loss(logp, old, adv, clamp):
    ratio = math.exp(min(max(logp - old, -clamp), clamp))
    return max(-adv * ratio, -adv * min(max(ratio, 0.8), 1.2))


@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_clamp(kind):
    logp, ref = rand(B, T, seed=60, scale=4.0), rand(B, T, seed=61, scale=4.0)
    got = kl_penalty(logp, ref, kind, clamp=10.0)
    want = [[min(max(ref_kl(a, b, kind), -10.0), 10.0) for a, b in zip(ra, rb)]
            for ra, rb in zip(lists(logp), lists(ref))]
    torch.testing.assert_close(got, tensor(want), **TOL)
    if kind != "k1":
        assert (got == 10.0).any()  # the clamp was exercised


# --- rollout correction ---------------------------------------------------------------------

def _correction_inputs():
    engine = rand(B, T, seed=70, scale=0.5) - 2.0
    old = engine + rand(B, T, seed=71, scale=0.6)
    return old, engine, make_mask()


@pytest.mark.parametrize("mode", ["tis", "mis"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_rollout_correction_weights(mode, level):
    """TIS: w = min(pi_old / pi_engine, C); MIS: w where 1/C <= w <= C, else 0; per token, or
    per sequence as the product over its tokens."""
    old, engine, mask = _correction_inputs()
    high = 2.0 if level == "token" else 2.5
    weights, stats = rollout_correction(old, engine, mask, mode=mode, level=level, high=high)
    want, ratios = [], []
    for o, g, (s, e) in zip(lists(old), lists(engine), SPANS):
        if level == "token":
            row_ratios = [math.exp(o[t] - g[t]) for t in range(s, e)]
            per_token = row_ratios
        else:
            row_ratios = [math.exp(sum(o[t] - g[t] for t in range(s, e)))]
            per_token = row_ratios * (e - s)
        ratios += row_ratios
        fix = ((lambda w: min(w, high)) if mode == "tis"
               else (lambda w: w if 1 / high <= w <= high else 0.0))
        row = [0.0] * T
        for t, w in zip(range(s, e), per_token):
            row[t] = fix(w)
        want.append(row)
    torch.testing.assert_close(weights, tensor(want), **TOL)
    changed = [w for w in ratios if (w > high if mode == "tis" else not 1 / high <= w <= high)]
    assert stats["rollout/is_ratio_mean"] == pytest.approx(statistics.fmean(ratios), rel=1e-12)
    assert stats["rollout/is_ratio_max"] == pytest.approx(max(ratios), rel=1e-12)
    assert stats["rollout/is_clipped_frac"] == pytest.approx(len(changed) / len(ratios))
    assert 0 < len(changed) < len(ratios)  # both branches taken


def test_rollout_correction_of_identical_logprobs_changes_nothing():
    old, _, mask = _correction_inputs()
    weights, stats = rollout_correction(old, old, mask, mode="tis", level="sequence", high=2.0)
    assert torch.equal(weights, mask.double())
    assert stats == {"rollout/is_ratio_mean": 1.0, "rollout/is_ratio_max": 1.0,
                     "rollout/is_clipped_frac": 0.0}


# --- DAPO -----------------------------------------------------------------------------------

def test_overlong_penalty_is_dapos_soft_punishment():
    lengths = torch.tensor([0, 10, 12, 13, 15, 16])
    got = overlong_penalty(lengths, max_len=16, buffer=4, factor=0.5)
    # L_max - L_cache = 12: free up to 12, then -(|y| - 12) / 4 * 0.5 down to -0.5 at 16.
    want = [0.0, 0.0, 0.0, -0.125, -0.375, -0.5]
    assert got.tolist() == pytest.approx(want, abs=1e-7)
    with pytest.raises(ValueError, match="need 0 < buffer <= max_len"):
        overlong_penalty(lengths, max_len=16, buffer=17)


def test_varied_groups_are_those_with_unequal_rewards():
    score = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 0.5])
    assert varied_groups(score, 3).tolist() == [False, True, False]


# --- advantages of the group methods --------------------------------------------------------

def _config(algorithm, **fields):
    from megarlhf.ppo.config import PPOConfig

    return PPOConfig(**{"actor": "a", "critic": "c", "prompts": "p", "out_dir": "o",
                        # opd trains without a reward (a teacher with one is not run yet).
                        "reward_fn": None if algorithm == "opd" else "m:f",
                        "algorithm": algorithm,
                        "prompts_per_step": B // 3, "samples_per_prompt": 3, **fields})


@pytest.mark.parametrize("algorithm", ["grpo", "rloo", "dr_grpo"])
def test_in_reward_kl_of_group_methods_comes_off_each_samples_score(algorithm):
    """kl_in=reward with a group estimator: score_i - coef * sum_t kl_t (verl sums the
    token-level rewards), then the estimator; Dr. GRPO's without the std."""
    from megarlhf.ppo.controller import compute_advantages

    score, mask = rand(B, seed=80), make_mask()
    logp, ref = rand(B, T, seed=81), rand(B, T, seed=82)
    config = _config(algorithm, kl_in="reward", kl_estimator="k2", kl_clamp=None)
    got, returns = compute_advantages(config, score, {"logp": logp, "ref_logp": ref}, mask,
                                      kl_coef=0.1)
    shaped = [sc - 0.1 * sum(ref_kl(lp[t], rf[t], "k2") for t in range(s, e))
              for sc, lp, rf, (s, e) in zip(lists(score), lists(logp), lists(ref), SPANS)]
    per_row = []
    for g in range(0, B, 3):
        group = shaped[g:g + 3]
        for i, x in enumerate(group):
            if algorithm == "rloo":
                per_row.append(x - (sum(group) - x) / 2)
            elif algorithm == "dr_grpo":
                per_row.append(x - statistics.fmean(group))
            else:
                per_row.append((x - statistics.fmean(group)) / (statistics.stdev(group) + 1e-6))
    want = [[per_row[j] if s <= t < e else 0.0 for t in range(T)]
            for j, (s, e) in enumerate(SPANS)]
    torch.testing.assert_close(got, tensor(want), **TOL)
    assert returns is None


# --- presets and options --------------------------------------------------------------------

def test_presets_are_what_their_papers_and_verl_name():
    o = {name: resolve(_config(name, **({"teacher": "t"} if name == "opd" else {})))
         for name in PRESETS}
    assert (o["grpo"].kl_in, o["grpo"].kl_estimator, o["grpo"].kl_coef) == ("loss", "k3", 0.001)
    assert not o["grpo"].whiten_advantages and not o["rloo"].whiten_advantages
    assert o["ppo"].whiten_advantages and o["ppo"].estimator == "gae"
    assert (o["dapo"].clip_eps, o["dapo"].clip_eps_high, o["dapo"].kl_coef) == (0.2, 0.28, 0.0)
    assert o["dapo"].dynamic_sampling and o["dapo"].aggregation == "token_mean"
    assert o["dapo"].overlong_buffer == 16 // 5  # a fifth of max_new_tokens (16)
    assert not o["dr_grpo"].advantage_std_norm and o["dr_grpo"].kl_coef == 0.0
    assert o["dr_grpo"].aggregation == "seq_mean_token_sum_norm"
    assert (o["gspo"].ratio_level, o["gspo"].clip_eps, o["gspo"].clip_eps_high) == \
        ("sequence", 3e-4, 4e-4)
    assert o["gspo"].aggregation == "seq_mean_token_mean"
    assert (o["cispo"].policy_loss, o["cispo"].clip_eps, o["cispo"].clip_eps_high) == \
        ("cispo", 1.0, 0.2)
    assert (o["opd"].distill_coef, o["opd"].kl_coef, o["opd"].whiten_advantages) == \
        (1.0, 0.0, False)
    assert all(o[name].distill_coef == 0.0 for name in PRESETS if name != "opd")


def test_a_field_set_in_the_config_wins_over_the_preset():
    o = resolve(_config("dapo", clip_eps_high=0.3, dynamic_sampling=False, kl_coef=0.01,
                        overlong_buffer=0))
    assert (o.clip_eps_high, o.dynamic_sampling, o.kl_coef, o.overlong_buffer) == \
        (0.3, False, 0.01, 0)
    assert o.kl_in == "loss" and o.clip_eps == 0.2  # the rest stays DAPO's
    assert resolve(_config("grpo", clip_eps=0.1)).clip_eps_high == 0.1  # follows clip_eps


@pytest.mark.parametrize("fields,message", [
    (dict(algorithm="reinforce++", whiten_advantages=True), "whitens its returns inside"),
    (dict(algorithm="rloo", advantage_std_norm=True), "advantage_std_norm applies to"),
    (dict(algorithm="cispo", dual_clip=3.0), "policy_loss=cispo has none"),
    (dict(algorithm="grpo", aggregation_norm=64), "aggregation_norm is the constant"),
    (dict(algorithm="dapo", overlong_buffer=17), "longer than max_new_tokens=16"),
    (dict(algorithm="dapo", kl_target=0.1), "kl_target steers kl_coef"),
    (dict(algorithm="grpo", rollout_correction="tis", rollout_correction_threshold_low=0.5),
     "needs rollout_correction=mis"),
    (dict(algorithm="grpo", rollout_correction_threshold=1.0),
     r"rollout_correction_threshold=1.0 is out of range"),
    (dict(algorithm="grpo", ratio_level="row"), "ratio_level='row' is not one of"),
    (dict(algorithm="grpo", clip_eps=1.5), r"clip_eps=1.5 is out of range"),
])
def test_option_mistakes_are_named(fields, message):
    with pytest.raises(ValueError, match=message):
        _config(**fields)


# --- on-policy distillation -----------------------------------------------------------------

def test_opd_advantages_are_the_teacher_minus_the_student_per_token():
    """algorithm=opd: each response token's advantage is distill_coef x (teacher - old
    logprob), worked out here in Python floats: no reward term, no whitening, no discount
    (the tokens of a row differ), 0 off the mask (an episode's observations and padding),
    clamped by distill_clip; a teacher equal to the student gives exactly 0."""
    from megarlhf.ppo.controller import compute_advantages

    score, mask = rand(B, seed=90), make_mask()
    logp, teacher = rand(B, T, seed=91), rand(B, T, seed=92)
    exp = {"logp": logp, "ref_logp": rand(B, T, seed=93), "teacher_logp": teacher}
    want = [[0.7 * (te - lp) if s <= t < e else 0.0 for t, (te, lp) in enumerate(zip(tr, lr))]
            for tr, lr, (s, e) in zip(lists(teacher), lists(logp), SPANS)]
    got, returns = compute_advantages(_config("opd", teacher="t", distill_coef=0.7), score,
                                      exp, mask, kl_coef=0.0)
    torch.testing.assert_close(got, tensor(want), **TOL)
    assert returns is None
    clipped, _ = compute_advantages(_config("opd", teacher="t", distill_coef=0.7,
                                            distill_clip=0.3), score, exp, mask, kl_coef=0.0)
    torch.testing.assert_close(clipped, tensor([[min(max(a, -0.3), 0.3) for a in row]
                                                for row in want]), **TOL)
    assert 0 < float((clipped.abs() == 0.3).sum()) < float((mask > 0).sum())  # both kinds
    same, _ = compute_advantages(_config("opd", teacher="t"), score,
                                 {**exp, "teacher_logp": logp.clone()}, mask, kl_coef=0.0)
    assert bool((same == 0).all())


def test_distillation_is_added_to_grpo_after_its_normalisation_and_whitening():
    """grpo with whiten_advantages and distill_coef: the group-normalised score (over the
    scored members), whitened over the trained tokens, plus the clamped distillation term,
    worked out here in Python floats. Row 0 failed (not trained: its mask is 0) and row 4
    has a hole (an episode's observation token): neither carries any term."""
    from megarlhf.ppo.controller import compute_advantages

    score, mask = rand(B, seed=94), make_mask()
    mask[0] = 0.0  # the controller's mask: response tokens x trained samples
    mask[4, 6] = 0.0
    trained = torch.tensor([False] + [True] * (B - 1))
    logp, teacher = rand(B, T, seed=95), rand(B, T, seed=96)
    config = _config("grpo", teacher="t", distill_coef=0.5, distill_clip=0.4,
                     whiten_advantages=True, kl_coef=0.0)
    got, _ = compute_advantages(config, score, {"logp": logp, "teacher_logp": teacher}, mask,
                                kl_coef=0.0, trained=trained)
    rows, on = lists(score), lists(mask)
    grpo = []
    for i in range(B):
        members = [rows[j] for j in range(i - i % 3, i - i % 3 + 3) if trained[j]]
        grpo.append((rows[i] - statistics.fmean(members)) / (statistics.stdev(members) + 1e-6))
    tokens = [grpo[i] for i in range(B) for t in range(T) if on[i][t]]
    mean, std = statistics.fmean(tokens), statistics.stdev(tokens)
    want = [[(grpo[i] - mean) / math.sqrt(std ** 2 + 1e-8)
             + min(max(0.5 * (te - lp), -0.4), 0.4) if on[i][t] else 0.0
             for t, (te, lp) in enumerate(zip(tr, lr))]
            for i, (tr, lr) in enumerate(zip(lists(teacher), lists(logp)))]
    torch.testing.assert_close(got, tensor(want), **TOL)
    assert got[0].abs().sum() == 0 and got[4, 6] == 0


@pytest.mark.parametrize("algorithm", [a for a in PRESETS if a != "opd"])
def test_distill_coef_adds_the_same_term_to_every_algorithms_advantages(algorithm):
    """Every other algorithm with distill_coef: its advantages without a teacher (each
    estimator checked against its reference above) plus the clamped distillation term of
    response token (none on an observation), worked out here in Python floats: the term never
    enters the estimator (its normalisation, whitening, GAE or returns)."""
    from megarlhf.ppo.controller import compute_advantages

    score, mask = rand(B, seed=97), make_mask()
    mask[4, 6] = 0.0  # an episode's observation token
    trained = torch.ones(B, dtype=torch.bool)
    exp = {"logp": rand(B, T, seed=98), "ref_logp": rand(B, T, seed=99),
           "values": rand(B, T, seed=100), "teacher_logp": rand(B, T, seed=101)}
    alone, _ = compute_advantages(_config(algorithm), score, exp, mask, kl_coef=0.05,
                                  trained=trained)
    got, _ = compute_advantages(_config(algorithm, teacher="t", distill_coef=0.5,
                                        distill_clip=0.4),
                                score, exp, mask, kl_coef=0.05, trained=trained)
    want = [[a + min(max(0.5 * (te - lp), -0.4), 0.4) if on else 0.0
             for a, te, lp, on in zip(*rows)]
            for rows in zip(lists(alone), lists(exp["teacher_logp"]), lists(exp["logp"]),
                            lists(mask))]
    torch.testing.assert_close(got, tensor(want), **TOL)


@pytest.mark.parametrize("fields,message", [
    (dict(algorithm="opd"), r"distill_coef=1.0 \(algorithm opd\) needs teacher"),
    (dict(algorithm="grpo", distill_coef=0.5), "needs teacher"),
    (dict(algorithm="grpo", teacher="t"), "teacher is set, but distill_coef is 0"),
    (dict(algorithm="grpo", distill_clip=1.0), "distill_clip bounds the distillation term"),
    (dict(algorithm="opd", teacher="t", distill_clip=0.0), "distill_clip=0.0 is out of range"),
    # Settings no test has run with a teacher yet are refused, each named with its fix.
    (dict(algorithm="opd", teacher="t", nproc=2, context_parallel=2),
     "teacher with context or expert parallelism: not run yet with a teacher; lay the actor "
     "out in TP x PP x DP"),
    (dict(algorithm="grpo", teacher="t", distill_coef=0.5, reward_model="rm"),
     "teacher with a reward model or judge: not run yet with a teacher; score with reward_fn"),
    (dict(algorithm="opd", teacher="t", dtype="fp16"),
     "teacher with dtype=fp16: not run yet with a teacher; use dtype=bf16 or fp32"),
    (dict(algorithm="opd", teacher="t", placement="disaggregated", teacher_nproc=2,
          layout=Layout(teacher=RoleLayout(context_parallel=2))),
     "teacher with context or expert parallelism on its own ranks: not run yet with a "
     "teacher; lay layout.teacher out in TP x PP x DP"),
    (dict(algorithm="opd", teacher="t", placement="disaggregated", teacher_nproc=2,
          layout=Layout(teacher=RoleLayout(pipeline_parallel=2))),
     "teacher with pipeline parallelism on its own ranks: not run yet with a teacher; lay "
     "layout.teacher out in TP x DP"),
    # A teacher on ranks of its own (teacher_nproc): its layout and its share of the batch.
    (dict(algorithm="opd", teacher="t", placement="disaggregated", teacher_nproc=4,
          prompts_per_step=3, samples_per_prompt=2),
     r"6 rows do not split over the teachers' DP \(4 = teacher_nproc / \(TP x PP\)\) x "
     r"micro_batches \(1\); change teacher_nproc"),
    (dict(algorithm="opd", teacher="t", placement="disaggregated", teacher_nproc=2,
          layout=Layout(teacher=RoleLayout(recompute="full"))),
     "layout.teacher.recompute=full: the teacher model is frozen"),
    (dict(algorithm="opd", teacher="t", placement="disaggregated", teacher_nproc=2,
          layout=Layout(teacher=RoleLayout(lora=LoraConfig()))),
     "layout.teacher.lora: the teacher model is frozen"),
    # opd trains on the teacher's term alone: settings it would ignore are refused.
    (dict(algorithm="opd", teacher="t", distill_coef=0.0), "set distill_coef > 0"),
    (dict(algorithm="opd", teacher="t", kl_coef=0.05, clip_reward=1.0),
     "kl_coef, clip_reward would change nothing: unset them"),
])
def test_distillation_mistakes_are_named(fields, message):
    with pytest.raises(ValueError, match=message):
        _config(**fields)


def test_opd_needs_no_reward_groups_or_critic_and_reads_the_old_logprobs_first():
    from megarlhf.ppo.config import PPOConfig

    config = PPOConfig(actor="a", prompts="p", out_dir="o", algorithm="opd", teacher="t",
                       samples_per_prompt=1)
    assert not config.options.critic and config.options.kl_coef == 0.0
    # The advantages read the actor's old logprobs: never the update pass's own.
    assert not config.one_pass_old_logprobs
