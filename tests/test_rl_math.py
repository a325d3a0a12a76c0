"""RL math against direct Python loops over the formulas as the DeepSpeed-Chat / OpenRLHF
write-ups state them, on random inputs with ragged responses (rows of different lengths, rows
that start after prompt positions, a one-token row, a row without right padding).

Tolerance: everything runs in float64 and the loops use Python floats (also float64); the two
sides differ only in summation order, ~1e-15 relative. We allow 1e-10: far below any formula
error (an off-by-one in time or a missing discount changes values at 1e-2 or more).
"""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from megarlhf.parallel import launch_local
from megarlhf.rl import (
    AGGREGATION_MODES, AdaptiveKLController, FixedKLController, aggregate, critic_free_advantages, ema_update,
    entropy_bonus, gae, grpo_advantages, kl_penalty, kl_shaped_rewards, masked_whiten,
    policy_loss, reinforce_pp_advantages, reinforce_pp_baseline_advantages, rloo_advantages,
    value_loss,
)
from tests import rl_workers

TOL = dict(atol=1e-10, rtol=0)
T = 10
# (start, end) of each row's response: full row, offset to the end, one token, right padding
# only, offsets on both sides, both again. Groups of 3 rows share a prompt in GRPO/RLOO tests.
SPANS = [(0, 10), (3, 10), (4, 5), (0, 4), (5, 9), (1, 7)]
B = len(SPANS)


def make_mask(spans=SPANS, width=T) -> torch.Tensor:
    mask = torch.zeros(len(spans), width)
    for row, (start, end) in enumerate(spans):
        mask[row, start:end] = 1
    return mask


def rand(*shape, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64) * scale


def lists(x: torch.Tensor):
    """Nested Python floats, for the reference loops."""
    return x.tolist()


# --- reference loops ----------------------------------------------------------------------

def ref_kl(logp: float, ref: float, kind: str) -> float:
    if kind == "k1":
        return logp - ref
    if kind == "k2":
        return 0.5 * (logp - ref) ** 2
    return math.exp(ref - logp) - (ref - logp) - 1


def ref_shaped_rewards(score, logp, ref, spans, kl_coef, kind, clip):
    """DeepSpeed-Chat compute_rewards: -kl_coef*kl on the response, clipped score at its end."""
    rewards = [[0.0] * T for _ in spans]
    for j, (start, end) in enumerate(spans):
        for t in range(start, end):
            rewards[j][t] = -kl_coef * ref_kl(logp[j][t], ref[j][t], kind)
        s = score[j] if clip is None else min(max(score[j], -clip), clip)
        rewards[j][end - 1] += s
    return rewards


def ref_gae(rewards, values, spans, gamma, lam):
    """DeepSpeed-Chat get_advantages_and_returns on each row's response slice."""
    adv = [[0.0] * T for _ in spans]
    ret = [[0.0] * T for _ in spans]
    for j, (start, end) in enumerate(spans):
        last = 0.0
        for t in reversed(range(start, end)):
            next_value = values[j][t + 1] if t + 1 < end else 0.0
            delta = rewards[j][t] + gamma * next_value - values[j][t]
            last = delta + gamma * lam * last
            adv[j][t] = last
            ret[j][t] = last + values[j][t]
    return adv, ret


def ref_whiten(x, spans, shift_mean=True, eps=1e-8):
    picked = [x[j][t] for j, (s, e) in enumerate(spans) for t in range(s, e)]
    mean = statistics.fmean(picked)
    var = sum((v - mean) ** 2 for v in picked) / (len(picked) - 1)  # two-pass, centred
    out = [[0.0] * T for _ in spans]
    for j, (s, e) in enumerate(spans):
        for t in range(s, e):
            out[j][t] = (x[j][t] - mean) / math.sqrt(var + eps) + (0 if shift_mean else mean)
    return out


def ref_returns_to_go(rewards, spans, gamma):
    """OpenRLHF get_cumulative_returns."""
    out = [[0.0] * T for _ in spans]
    for j, (s, e) in enumerate(spans):
        g = 0.0
        for t in reversed(range(s, e)):
            g = rewards[j][t] + gamma * g
            out[j][t] = g
    return out


def broadcast(adv_per_row, spans):
    return [[adv_per_row[j] if s <= t < e else 0.0 for t in range(T)]
            for j, (s, e) in enumerate(spans)]


def ref_policy_loss(logp, old, adv, eps_low, eps_high, dual):
    ratio = math.exp(logp - old)
    unclipped = -adv * ratio
    clipped = -adv * min(max(ratio, 1 - eps_low), 1 + eps_high)
    loss = max(unclipped, clipped)
    dual_taken = False
    if dual is not None and adv < 0 and -dual * adv < loss:
        loss, dual_taken = -dual * adv, True
    return loss, clipped > unclipped, dual_taken, ratio - 1 - math.log(ratio)


def tensor(rows):
    return torch.tensor(rows, dtype=torch.float64)


# --- KL ------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["k1", "k2", "k3"])
def test_kl_penalty_matches_formula(kind):
    logp, ref = rand(B, T, seed=1), rand(B, T, seed=2)
    want = [[ref_kl(a, b, kind) for a, b in zip(ra, rb)] for ra, rb in zip(lists(logp), lists(ref))]
    torch.testing.assert_close(kl_penalty(logp, ref, kind), tensor(want), **TOL)


def test_kl_penalty_rejects_unknown_kind_and_shape_mismatch():
    with pytest.raises(ValueError, match=r"unknown KL estimator 'kl'.*'k1', 'k2', 'k3'"):
        kl_penalty(rand(2, 3, seed=0), rand(2, 3, seed=0), "kl")
    with pytest.raises(ValueError, match=r"logp \(2, 3\), ref_logp \(2, 4\)"):
        kl_penalty(rand(2, 3, seed=0), rand(2, 4, seed=0), "k1")


@pytest.mark.parametrize("kind,clip", [("k1", None), ("k1", 1.5), ("k3", 1.5), ("k2", None)])
def test_kl_shaped_rewards_match_deepspeed_chat(kind, clip):
    score = rand(B, seed=3, scale=3.0)
    if clip is not None:
        assert (score.abs() > clip).any() and (score.abs() < clip).any()  # clipping matters
    logp, ref, mask = rand(B, T, seed=4), rand(B, T, seed=5), make_mask()
    got = kl_shaped_rewards(score, logp, ref, mask, kl_coef=0.05, kind=kind, clip_reward=clip)
    want = ref_shaped_rewards(lists(score), lists(logp), lists(ref), SPANS, 0.05, kind, clip)
    torch.testing.assert_close(got, tensor(want), **TOL)


def test_kl_shaped_rewards_rejects_empty_row():
    mask = make_mask()
    mask[2] = 0
    with pytest.raises(ValueError, match=r"rows \[2\] have no response token"):
        kl_shaped_rewards(rand(B, seed=0), rand(B, T, seed=0), rand(B, T, seed=1), mask,
                          kl_coef=0.1)
    with pytest.raises(ValueError, match=r"mask \(6, 9\)"):
        kl_shaped_rewards(rand(B, seed=0), rand(B, T, seed=0), rand(B, T, seed=1),
                          mask[:, :9], kl_coef=0.1)


def test_fixed_kl_controller_does_not_move():
    ctl = FixedKLController(0.1)
    ctl.update(5.0, 64)
    assert ctl.value == 0.1
    # Resumed from a checkpoint written with another coefficient (an older default): the
    # configured one holds.
    ctl.load_state_dict({"value": 0.05})
    assert ctl.value == 0.1
    with pytest.raises(ValueError, match="exactly the key 'value'"):
        ctl.load_state_dict({"coef": 0.1})


def test_adaptive_kl_controller_moves_towards_target_and_resumes_exactly():
    ctl = AdaptiveKLController(init_kl_coef=0.1, target=6.0, horizon=10000)
    ctl.update(9.0, 256)  # KL above target: raise the coefficient, err = +0.2 (clipped from 0.5)
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 256 / 10000), rel=1e-15)
    before = ctl.value
    ctl.update(5.4, 256)  # below target: lower it, err = -0.1 (not clipped)
    assert ctl.value == pytest.approx(before * (1 - 0.1 * 256 / 10000), rel=1e-15)

    saved = ctl.state_dict()
    resumed = AdaptiveKLController(init_kl_coef=0.5, target=6.0, horizon=10000)
    resumed.load_state_dict(saved)
    for kl in (7.0, 1.0, 6.5, 30.0):
        ctl.update(kl, 128)
        resumed.update(kl, 128)
        assert resumed.value == ctl.value  # bit-identical after resume
    with pytest.raises(ValueError, match="exactly the key 'value'"):
        resumed.load_state_dict({"kl_coef": 0.1})
    with pytest.raises(ValueError, match="must all be > 0"):
        AdaptiveKLController(init_kl_coef=0.1, target=0.0, horizon=10)


# --- advantages ----------------------------------------------------------------------------

@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.8), (0.99, 1.0)])
def test_gae_matches_reversed_loop(gamma, lam):
    rewards, values, mask = rand(B, T, seed=6), rand(B, T, seed=7), make_mask()
    # Garbage outside the response must not leak in.
    rewards = torch.where(mask.bool(), rewards, 1e3)
    values = torch.where(mask.bool(), values, -1e3)
    adv, ret = gae(rewards, values, mask, gamma=gamma, lam=lam)
    want_adv, want_ret = ref_gae(lists(rewards), lists(values), SPANS, gamma, lam)
    torch.testing.assert_close(adv, tensor(want_adv), **TOL)
    torch.testing.assert_close(ret, tensor(want_ret), **TOL)


def test_gae_skips_gaps_in_a_multi_run_mask():
    # Turns at [1,3) and [5,8): equal to GAE over the six response tokens laid end to end.
    mask = torch.tensor([[0, 1, 1, 0, 0, 1, 1, 1, 0, 0]], dtype=torch.float64)
    rewards, values = rand(1, T, seed=8), rand(1, T, seed=9)
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.7)
    keep = mask[0].bool()
    packed_r, packed_v = rewards[:, keep], values[:, keep]
    want_adv, want_ret = ref_gae(lists(packed_r), lists(packed_v), [(0, 5)], 0.9, 0.7)
    torch.testing.assert_close(adv[:, keep], tensor(want_adv)[:, :5], **TOL)
    torch.testing.assert_close(ret[:, keep], tensor(want_ret)[:, :5], **TOL)
    assert adv[:, ~keep].abs().max() == 0


def test_gae_rejects_bad_inputs():
    with pytest.raises(ValueError, match=r"gamma must be in \[0, 1\]"):
        gae(rand(2, 3, seed=0), rand(2, 3, seed=0), torch.ones(2, 3), gamma=1.1, lam=0.9)
    with pytest.raises(ValueError, match=r"values \(2, 4\)"):
        gae(rand(2, 3, seed=0), rand(2, 4, seed=0), torch.ones(2, 3), gamma=1.0, lam=0.9)


@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_matches_two_pass_statistics(shift_mean):
    x, mask = rand(B, T, seed=10, scale=3.0) + 5.0, make_mask()
    x = torch.where(mask.bool(), x, 1e6)  # masked values must not enter the statistics
    got = masked_whiten(x, mask, shift_mean=shift_mean)
    torch.testing.assert_close(got, tensor(ref_whiten(lists(x), SPANS, shift_mean)), **TOL)


def test_masked_whiten_needs_two_elements():
    mask = torch.zeros(2, 3)
    mask[1, 2] = 1
    with pytest.raises(ValueError, match="at least 2 masked elements"):
        masked_whiten(rand(2, 3, seed=0), mask)


@pytest.mark.parametrize("scale_by_std", [True, False])
def test_grpo_matches_group_loop(scale_by_std):
    score, mask = rand(B, seed=11), make_mask()
    got = grpo_advantages(score, mask, group_size=3, scale_by_std=scale_by_std)
    s, want = lists(score), []
    for i in range(B):
        group = s[i - i % 3:i - i % 3 + 3]
        a = s[i] - statistics.fmean(group)
        want.append(a / (statistics.stdev(group) + 1e-6) if scale_by_std else a)
    torch.testing.assert_close(got, tensor(broadcast(want, SPANS)), **TOL)


def test_rloo_matches_leave_one_out_loop():
    score, mask = rand(B, seed=12), make_mask()
    got = rloo_advantages(score, mask, group_size=3)
    s = lists(score)
    want = [s[i] - statistics.fmean([s[j] for j in range(i - i % 3, i - i % 3 + 3) if j != i])
            for i in range(B)]
    torch.testing.assert_close(got, tensor(broadcast(want, SPANS)), **TOL)


def _reinforce_inputs(seed=13):
    return dict(score=rand(B, seed=seed, scale=2.0), logp=rand(B, T, seed=seed + 1),
                ref=rand(B, T, seed=seed + 2), mask=make_mask())


def test_reinforce_pp_matches_loop():
    d = _reinforce_inputs()
    got = reinforce_pp_advantages(d["score"], d["mask"], logp_BT=d["logp"],
                                  ref_logp_BT=d["ref"], kl_coef=0.1, gamma=0.9, clip_reward=1.0)
    rewards = ref_shaped_rewards(lists(d["score"]), lists(d["logp"]), lists(d["ref"]), SPANS,
                                 0.1, "k1", 1.0)
    want = ref_whiten(ref_returns_to_go(rewards, SPANS, 0.9), SPANS)
    torch.testing.assert_close(got, tensor(want), **TOL)


def test_reinforce_pp_baseline_subtracts_group_mean_first():
    d = _reinforce_inputs()
    got = critic_free_advantages("reinforce++_baseline", d["score"], d["mask"], group_size=2,
                                 logp_BT=d["logp"], ref_logp_BT=d["ref"], kl_coef=0.1, gamma=1.0)
    s = lists(d["score"])
    centred = [s[i] - (s[i - i % 2] + s[i - i % 2 + 1]) / 2 for i in range(B)]
    rewards = ref_shaped_rewards(centred, lists(d["logp"]), lists(d["ref"]), SPANS, 0.1, "k1", None)
    want = ref_whiten(ref_returns_to_go(rewards, SPANS, 1.0), SPANS)
    torch.testing.assert_close(got, tensor(want), **TOL)
    plain = reinforce_pp_advantages(d["score"], d["mask"], logp_BT=d["logp"],
                                    ref_logp_BT=d["ref"], kl_coef=0.1)
    assert (got - plain).abs().max() > 1e-2  # the baseline changes the result


def test_critic_free_dispatch_and_bad_groups():
    score, mask = rand(B, seed=14), make_mask()
    torch.testing.assert_close(critic_free_advantages("rloo", score, mask, group_size=2),
                               rloo_advantages(score, mask, group_size=2), **TOL)
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'ppo'.*'grpo'"):
        critic_free_advantages("ppo", score, mask)
    with pytest.raises(ValueError, match="does not split into groups of 4"):
        grpo_advantages(score, mask, group_size=4)
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        rloo_advantages(score, mask, group_size=1)
    with pytest.raises(ValueError, match=r"scores \(5,\) must be \[B\]"):
        reinforce_pp_baseline_advantages(score[:5], mask, group_size=2, logp_BT=mask,
                                         ref_logp_BT=mask, kl_coef=0.1)


# --- losses --------------------------------------------------------------------------------

@pytest.mark.parametrize("eps_high,dual", [(None, None), (0.28, None), (None, 3.0)])
def test_policy_loss_matches_elementwise_formula(eps_high, dual):
    old = rand(B, T, seed=16, scale=0.5) - 2.0
    logp = old + rand(B, T, seed=15)  # log-ratio ~ N(0, 1): clipped, unclipped, dual-clipped
    adv, mask = rand(B, T, seed=17), make_mask()
    loss, stats = policy_loss(logp, old, adv, mask, clip_eps=0.2, clip_eps_high=eps_high,
                              dual_clip=dual)
    rows = [[ref_policy_loss(a, b, c, 0.2, eps_high or 0.2, dual) if m else (0.0, 0, 0, 0.0)
             for a, b, c, m in zip(*r)]
            for r in zip(lists(logp), lists(old), lists(adv), lists(mask))]
    for k, got in enumerate([loss, stats["clipped"], stats["dual_clipped"], stats["approx_kl"]]):
        torch.testing.assert_close(got, tensor([[float(x[k]) for x in r] for r in rows]), **TOL)
    # The inputs exercise every branch, so a wrong branch would show.
    frac = stats["clipped"].sum() / mask.sum()
    assert 0.1 < frac < 0.9, frac
    if dual is not None:
        assert stats["dual_clipped"].sum() > 0


def test_policy_loss_rejects_bad_inputs():
    x, mask = rand(2, 3, seed=0), torch.ones(2, 3)
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        policy_loss(x, x, x, mask, clip_eps=0.2, dual_clip=1.0)
    with pytest.raises(ValueError, match=r"0 < clip_eps <= 1"):
        policy_loss(x, x, x, mask, clip_eps=0.0)
    with pytest.raises(ValueError, match=r"advantages \(2, 3\), mask \(3, 2\)"):
        policy_loss(x, x, x, torch.ones(3, 2), clip_eps=0.2)


@pytest.mark.parametrize("clip_eps", [None, 0.2])
def test_value_loss_matches_formula(clip_eps):
    v, old, ret, mask = rand(B, T, seed=18), rand(B, T, seed=19), rand(B, T, seed=20), make_mask()
    got = value_loss(v, old, ret, mask, clip_eps=clip_eps)
    want = []
    for rv, ro, rr, rm in zip(lists(v), lists(old), lists(ret), lists(mask)):
        row = []
        for a, o, r, m in zip(rv, ro, rr, rm):
            loss = (a - r) ** 2
            if clip_eps is not None:
                loss = max(loss, (min(max(a, o - clip_eps), o + clip_eps) - r) ** 2)
            row.append(0.5 * loss if m else 0.0)
        want.append(row)
    torch.testing.assert_close(got, tensor(want), **TOL)
    if clip_eps is not None:
        assert (got - value_loss(v, old, ret, mask, clip_eps=None)).abs().max() > 1e-2
    with pytest.raises(ValueError, match="clip_eps must be > 0 or None"):
        value_loss(v, old, ret, mask, clip_eps=0.0)


def test_aggregate_modes_match_loops():
    loss, mask = rand(B, T, seed=21), make_mask()
    mask[4] = 0  # a row without tokens: not a sequence of the mean
    rows = [[x for x, m in zip(r, rm) if m] for r, rm in zip(lists(loss), lists(mask))]
    num, den = aggregate(loss, mask, "token_mean")
    assert den.item() == sum(len(r) for r in rows) and den.dtype == torch.int64
    assert num.item() == pytest.approx(sum(map(sum, rows)), abs=1e-12)
    num, den = aggregate(loss, mask, "seq_mean_token_mean")
    assert den.item() == sum(1 for r in rows if r) == B - 1
    assert num.item() == pytest.approx(sum(statistics.fmean(r) for r in rows if r), abs=1e-12)
    num, den = aggregate(loss, mask, "seq_mean_token_sum")
    assert den.item() == B - 1 and num.item() == pytest.approx(sum(map(sum, rows)), abs=1e-12)
    num, den = aggregate(loss, mask, "seq_mean_token_sum_norm", norm=16)
    assert den.item() == B - 1
    assert num.item() == pytest.approx(sum(map(sum, rows)) / 16, abs=1e-12)
    with pytest.raises(ValueError, match="norm .* goes with seq_mean_token_sum_norm only"):
        aggregate(loss, mask, "seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="norm .* goes with seq_mean_token_sum_norm only"):
        aggregate(loss, mask, "token_mean", norm=16)
    with pytest.raises(ValueError, match="unknown aggregation mode 'mean'"):
        aggregate(loss, mask, "mean")
    with pytest.raises(ValueError, match=r"loss \(6, 10\), mask \(6, 9\)"):
        aggregate(loss, mask[:, :9], "token_mean")
    num, den = entropy_bonus(loss.abs(), mask, coef=0.01, mode="token_mean")
    want_num, want_den = aggregate(-0.01 * loss.abs(), mask, "token_mean")
    assert num.item() == pytest.approx(want_num.item(), abs=1e-15) and den == want_den


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_aggregate_is_independent_of_the_micro_batch_split(mode):
    old, adv, mask = rand(B, T, seed=23, scale=0.5) - 2.0, rand(B, T, seed=24), make_mask()
    logp = (old + rand(B, T, seed=22, scale=0.3)).requires_grad_()
    mask[5] = 0  # a row without tokens (e.g. a prompt-only row) counts for nothing
    splits = {"one": [slice(0, B)], "three": [slice(0, 1), slice(1, 3), slice(3, B)]}
    results = {}
    for name, parts in splits.items():
        nums, dens = [], []
        for rows in parts:
            loss_BT, _ = policy_loss(logp[rows], old[rows], adv[rows], mask[rows], clip_eps=0.2)
            num, den = aggregate(loss_BT, mask[rows], mode,
                                 norm=T if mode == "seq_mean_token_sum_norm" else None)
            nums.append(num)
            dens.append(den)
        total = torch.stack(nums).sum() / torch.stack(dens).sum()
        (grad,) = torch.autograd.grad(total, logp)
        naive = torch.stack([n / d for n, d in zip(nums, dens)]).mean()
        results[name] = (total.detach(), grad, naive.detach())
    torch.testing.assert_close(results["three"][0], results["one"][0], **TOL)
    torch.testing.assert_close(results["three"][1], results["one"][1], **TOL)
    # The naive mean of micro-batch means differs, so this split would expose it.
    assert abs(results["three"][2] - results["one"][0]) > 1e-3


# --- EMA -----------------------------------------------------------------------------------

def test_ema_update_matches_formula_and_validates():
    ema = [rand(3, 4, seed=25), rand(5, seed=26).float()]
    params = [rand(3, 4, seed=27), rand(5, seed=28).bfloat16()]
    want = [0.9 * e.double() + 0.1 * p.double() for e, p in zip(ema, params)]
    ema_update(ema, params, 0.9)
    torch.testing.assert_close(ema[0], want[0], **TOL)
    # fp32 EMA of bf16 weights: fp32 rounding of the result (~6e-8 relative).
    torch.testing.assert_close(ema[1].double(), want[1], atol=1e-6, rtol=0)
    ema_update(ema, params, 0.0)
    assert torch.equal(ema[0], params[0])
    with pytest.raises(ValueError, match=r"beta must be in \[0, 1\], got 1.5"):
        ema_update(ema, params, 1.5)
    with pytest.raises(ValueError, match="1 EMA tensors for 2 parameters"):
        ema_update(ema[:1], params, 0.5)


# --- DP-global whitening (2 gloo ranks) ----------------------------------------------------

@pytest.mark.slow
def test_dp_global_whitening_equals_whitening_the_whole_batch():
    d = _reinforce_inputs(seed=30)
    # The two DP halves differ in scale, offset and token count: per-rank statistics would be
    # visibly wrong.
    x = rand(B, T, seed=31)
    x[B // 2:] = x[B // 2:] * 4 + 3
    data = {"x": x, "mask": d["mask"], "score": d["score"], "logp": d["logp"],
            "ref_logp": d["ref"]}
    outs = launch_local(rl_workers.dp_advantages, 2, data, 3)
    got = {k: torch.cat([o[k] for o in outs]) for k in outs[0]}
    shaping = dict(logp_BT=d["logp"], ref_logp_BT=d["ref"], kl_coef=0.1, gamma=0.9)
    want = {
        "whiten": masked_whiten(x, d["mask"]),
        "whiten_no_shift": masked_whiten(x, d["mask"], shift_mean=False),
        "reinforce++": reinforce_pp_advantages(d["score"], d["mask"], **shaping),
        "reinforce++_baseline": reinforce_pp_baseline_advantages(d["score"], d["mask"],
                                                                 group_size=3, **shaping),
    }
    for key in want:
        torch.testing.assert_close(got[key], want[key], **TOL, msg=key)
    per_rank = masked_whiten(x[:B // 2], d["mask"][:B // 2])
    assert (per_rank - want["whiten"][:B // 2]).abs().max() > 0.1


# --- the controller's choice of estimator -----------------------------------------------------


def _controller_config(algorithm: str, **fields):
    from megarlhf.ppo.config import PPOConfig

    return PPOConfig(actor="a", critic="c", prompts="p", out_dir="o", reward_fn="m:f",
                     algorithm=algorithm, prompts_per_step=B // 3, samples_per_prompt=3,
                     kl_estimator="k3", gamma=0.9, clip_reward=1.5, **fields)


@pytest.mark.parametrize("algorithm", ["reinforce++", "reinforce++_baseline"])
def test_controller_reinforce_pp_is_the_formula_whitened_once(algorithm):
    """Token-level KL (k3, coefficient 0.2) in the reward, returns discounted by 0.9, one
    whitening over the batch; the baseline variant first subtracts the group's mean score."""
    from megarlhf.ppo.controller import compute_advantages

    d = _reinforce_inputs(seed=40)
    config = _controller_config(algorithm, kl_clamp=None)
    exp = {"logp": d["logp"], "ref_logp": d["ref"]}
    got, returns = compute_advantages(config, d["score"], exp, d["mask"], kl_coef=0.2)
    s = lists(d["score"])
    if algorithm == "reinforce++_baseline":  # the total clipped, centred, clipped again below
        s = [min(max(v, -1.5), 1.5) for v in s]
        s = [s[i] - statistics.fmean(s[i - i % 3:i - i % 3 + 3]) for i in range(B)]
    rewards = ref_shaped_rewards(s, lists(d["logp"]), lists(d["ref"]), SPANS, 0.2, "k3", 1.5)
    want = ref_whiten(ref_returns_to_go(rewards, SPANS, 0.9), SPANS)
    torch.testing.assert_close(got, tensor(want), **TOL)
    assert returns is None


@pytest.mark.parametrize("algorithm", ["grpo", "rloo"])
def test_controller_group_estimators_whiten_only_when_asked(algorithm):
    """Group advantages are not whitened again over the batch (verl and OpenRLHF do not
    either), unless whiten_advantages=true."""
    from megarlhf.ppo.controller import compute_advantages

    score, mask = rand(B, seed=41), make_mask()
    exp = {"logp": torch.zeros(B, T), "ref_logp": torch.zeros(B, T)}
    plain, _ = compute_advantages(_controller_config(algorithm), score, exp, mask, kl_coef=0.2)
    torch.testing.assert_close(plain, critic_free_advantages(algorithm, score, mask,
                                                             group_size=3), **TOL)
    whitened, _ = compute_advantages(_controller_config(algorithm, whiten_advantages=True),
                                     score, exp, mask, kl_coef=0.2)
    torch.testing.assert_close(whitened, tensor(ref_whiten(lists(plain), SPANS)), **TOL)


# --- samples without a score, and clip_reward, through the controller ------------------------


def _config(algorithm: str, **fields):
    from megarlhf.ppo.config import PPOConfig

    return PPOConfig(actor="a", critic="c", prompts="p", out_dir="o", reward_fn="m:f",
                     algorithm=algorithm, **fields)


@pytest.mark.parametrize("algorithm", ["grpo", "rloo"])
def test_group_baselines_count_the_scored_members_only(algorithm):
    """Groups of 3: [1, 0, failed] trains its two scored samples against each other; [failed,
    2, failed] has one scored member left, so the whole group is masked (advantage 0, out
    of the mask). By hand: GRPO (r - 0.5) / (std([1, 0]) = sqrt(0.5)) + 1e-6); RLOO r minus
    the other member."""
    from megarlhf.ppo.controller import compute_advantages
    from megarlhf.rl import trained_samples

    config = _config(algorithm, prompts_per_step=2, samples_per_prompt=3)
    score = torch.tensor([1.0, 0.0, math.nan, math.nan, 2.0, math.nan])
    scored = ~score.isnan()
    trained = trained_samples(scored, 3)
    assert trained.tolist() == [True, True, False, False, False, False]
    mask = make_mask(width=T)[:6] * trained[:, None]
    exp = {"logp": torch.zeros(6, T), "ref_logp": torch.zeros(6, T)}
    got, _ = compute_advantages(config, torch.where(trained, score, 0.0), exp, mask, 0.0,
                                None, trained)
    step = 0.5 / (math.sqrt(0.5) + 1e-6) if algorithm == "grpo" else 1.0
    want = torch.tensor([step, -step, 0, 0, 0, 0])[:, None] * mask
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


def test_clip_reward_clips_each_turn_reward_and_the_total_on_both_paths():
    """clip_reward 1: turn rewards at tokens 1 and 3 (3.0, -0.5) and 2.0 more from the reward
    function. GAE (gamma = lam = 1, values 0, no KL): the returns are the clipped rewards to
    go, [0, 1, 0, -0.5 + (clip(1 - 0.5 + 2) - 0.5)] -> returns [1, 1, 0, 0]. GRPO: each
    sample's total of clipped turns and the rest, clipped: [3 | rest 0] -> 1, [-0.2, -0.3 |
    rest -2] -> -1, [0.4 | rest 0.1] -> 0.5; advantages by hand from those."""
    from megarlhf.ppo.controller import compute_advantages

    mask = torch.ones(3, 4)
    placed = torch.tensor([[0.0, 3.0, 0.0, -0.5], [0.0, -0.2, 0.0, -0.3],
                           [0.0, 0.0, 0.0, 0.4]])
    score = placed.sum(1) + torch.tensor([2.0, -2.0, 0.1])
    exp = {"logp": torch.zeros(3, 4), "ref_logp": torch.zeros(3, 4),
           "values": torch.zeros(3, 4)}
    ppo = _config("ppo", clip_reward=1.0, gamma=1.0, lam=1.0, prompts_per_step=3,
                  samples_per_prompt=1)
    _, returns = compute_advantages(ppo, score, exp, mask, 0.0, placed)
    torch.testing.assert_close(returns[0], torch.tensor([1.0, 1.0, 0.0, 0.0]))
    grpo = _config("grpo", clip_reward=1.0, prompts_per_step=1, samples_per_prompt=3)
    got, _ = compute_advantages(grpo, score, exp, mask, 0.0, placed)
    totals = [1.0, -1.0, 0.5]
    mean, std = statistics.fmean(totals), statistics.stdev(totals)
    want = torch.tensor([(t - mean) / (std + 1e-6) for t in totals])[:, None].expand(3, 4)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
