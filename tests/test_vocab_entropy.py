"""Vocab-parallel entropy (and the fused logprobs + entropy) against a full softmax.

Reference: float64 `log_softmax` over the real (unpadded) vocabulary on one process.
Tolerance: the vocab-parallel path computes in fp32. Values (log-probs down to ~-15 here,
entropies up to log V ~ 4) carry fp32 rounding of ~1e-7 relative: measured max 1.6e-6; we
allow 1e-5. Gradients (entries of order 1) measured max 5e-7; we allow 2e-6. A real error (a
padded column in the softmax, a missing all-reduce, a wrong gradient term) is 1e-2 or larger.
"""

from __future__ import annotations

import pytest
import torch

from megarlhf.parallel import launch_local
from megarlhf.parallel.vocab import (
    vocab_parallel_entropy, vocab_parallel_logprobs, vocab_parallel_logprobs_and_entropy,
)
from tests import rl_workers

VALUE_TOL = dict(atol=1e-5, rtol=0)
GRAD_TOL = dict(atol=2e-6, rtol=0)


def make_case(vocab_size: int, padded: int, *, seed: int, shape=(3, 5)) -> dict:
    g = torch.Generator().manual_seed(seed)
    # Scale 3: a mix of peaked and flat rows. Padding columns hold large logits on purpose:
    # if they entered the softmax, they would dominate it.
    logits = torch.randn(*shape, padded, generator=g, dtype=torch.float64) * 3
    logits[..., vocab_size:] = 10.0
    return {
        "logits": logits,
        "labels": torch.randint(0, vocab_size, shape, generator=g),
        "vocab_size": vocab_size,
        "w_logp": torch.randn(*shape, generator=g, dtype=torch.float64),
        "w_entropy": torch.randn(*shape, generator=g, dtype=torch.float64),
    }


def reference(case: dict) -> dict:
    """float64 values and gradients w.r.t. the full padded logits (0 on padding)."""
    logits = case["logits"].clone().requires_grad_()
    logp_all = torch.log_softmax(logits[..., :case["vocab_size"]], dim=-1)
    logp = logp_all.gather(-1, case["labels"].unsqueeze(-1)).squeeze(-1)
    # 0 * log 0 = 0 at logits of -inf, without a nan in the gradient either.
    entropy = -(logp_all.exp() * torch.where(logp_all.isfinite(), logp_all, 0.0)).sum(-1)
    out = {"logp": logp.detach(), "entropy": entropy.detach()}
    (out["logp_grad"],) = torch.autograd.grad((logp * case["w_logp"]).sum(), logits,
                                              retain_graph=True)
    (out["entropy_grad"],) = torch.autograd.grad((entropy * case["w_entropy"]).sum(), logits)
    out["fused_grad"] = out["logp_grad"] + out["entropy_grad"]
    return out


def check(got: dict, want: dict) -> None:
    for key in ("logp", "entropy"):
        torch.testing.assert_close(got[key].double(), want[key], **VALUE_TOL, msg=key)
        torch.testing.assert_close(got["fused_" + key].double(), want[key], **VALUE_TOL,
                                   msg="fused_" + key)
    for key in ("logp_grad", "entropy_grad", "fused_grad"):
        torch.testing.assert_close(got[key], want[key], **GRAD_TOL, msg=key)


def tp1(case: dict) -> dict:
    """The vocab-parallel functions on one process, outputs named as rl_workers returns them."""
    kw = dict(tp_group=None, vocab_start=0, vocab_size=case["vocab_size"])
    out = {}
    x = case["logits"].clone().requires_grad_()
    logp, entropy = vocab_parallel_logprobs_and_entropy(x, case["labels"], **kw)
    (out["fused_grad"],) = torch.autograd.grad(
        (logp * case["w_logp"] + entropy * case["w_entropy"]).sum(), x)
    out["fused_logp"], out["fused_entropy"] = logp.detach(), entropy.detach()
    x = case["logits"].clone().requires_grad_()
    entropy = vocab_parallel_entropy(x, **kw)
    (out["entropy_grad"],) = torch.autograd.grad((entropy * case["w_entropy"]).sum(), x)
    out["entropy"] = entropy.detach()
    x = case["logits"].clone().requires_grad_()
    logp = vocab_parallel_logprobs(x, case["labels"], **kw)
    (out["logp_grad"],) = torch.autograd.grad((logp * case["w_logp"]).sum(), x)
    out["logp"] = logp.detach()
    return out


def test_tp1_entropy_and_fused_match_full_softmax_with_padding_excluded():
    case = make_case(50, 64, seed=0)
    got, want = tp1(case), reference(case)
    check(got, want)
    assert want["entropy"].min() < 1.0 < want["entropy"].max()  # peaked and flat rows
    assert got["fused_grad"][..., 50:].abs().max() == 0  # padding gets no gradient
    # One pass, same arithmetic: the fused outputs are the separate ones, bit for bit.
    assert torch.equal(got["fused_logp"], got["logp"])
    assert torch.equal(got["fused_entropy"], got["entropy"])


def test_entropy_with_logits_masked_to_minus_infinity():
    # Samplers mask disallowed tokens to -inf; 0 * log 0 must count as 0, not nan.
    case = make_case(40, 40, seed=1)
    case["logits"][..., 5:12] = float("-inf")
    got, want = tp1(case), reference(case)
    assert torch.isfinite(want["entropy"]).all() and torch.isfinite(want["fused_grad"]).all()
    torch.testing.assert_close(got["entropy"].double(), want["entropy"], **VALUE_TOL)
    torch.testing.assert_close(got["entropy_grad"], want["entropy_grad"], **GRAD_TOL)
    torch.testing.assert_close(got["fused_grad"], want["fused_grad"], **GRAD_TOL)


def test_bf16_logits_give_bf16_gradients_and_fp32_values():
    case = make_case(50, 64, seed=2)
    x = case["logits"].bfloat16().requires_grad_()
    logp, entropy = vocab_parallel_logprobs_and_entropy(x, case["labels"], tp_group=None,
                                                        vocab_start=0, vocab_size=50)
    assert logp.dtype == entropy.dtype == torch.float32
    (grad,) = torch.autograd.grad(entropy.sum(), x)
    assert grad.dtype == torch.bfloat16


def test_rejects_bad_arguments():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        vocab_parallel_logprobs_and_entropy(torch.zeros(1, 2, 8), torch.tensor([[1, 9]]),
                                            tp_group=None, vocab_start=0, vocab_size=8)
    with pytest.raises(ValueError, match=r"logits \(1, 2, 8\) and labels \(1, 3\)"):
        vocab_parallel_logprobs_and_entropy(torch.zeros(1, 2, 8), torch.zeros(1, 3).long(),
                                            tp_group=None, vocab_start=0, vocab_size=8)
    with pytest.raises(ValueError, match="vocab_size >= 1"):
        vocab_parallel_entropy(torch.zeros(1, 2, 8), tp_group=None, vocab_start=0, vocab_size=0)


@pytest.mark.slow
def test_tp2_equals_full_softmax_with_padded_vocabulary():
    cases = [
        make_case(50, 64, seed=3),  # rank 1 holds 18 real ids and 14 padding rows
        make_case(30, 64, seed=4),  # rank 1 holds padding only
        make_case(64, 64, seed=5),  # no padding
    ]
    outs = launch_local(rl_workers.tp_vocab_softmax, 2, cases, 2)
    for i, case in enumerate(cases):
        want = reference(case)
        per_rank = [o[i] for o in outs]
        for rank, got in enumerate(per_rank):
            # Values are the same on every TP rank; gradients are per vocabulary slice.
            got = dict(got)
            for key in ("logp_grad", "entropy_grad", "fused_grad"):
                got[key] = torch.cat([r[key] for r in per_rank], dim=-1)
            check(got, want)
