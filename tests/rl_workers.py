"""Per-rank functions for the multi-process RL-math and vocab-parallel tests (importable).

Each returns plain tensors; the test compares them with the same computation on one process.
"""

from __future__ import annotations

import torch

from megarlhf.parallel.mesh import ParallelConfig, init_mesh
from megarlhf.parallel.vocab import (
    vocab_parallel_entropy, vocab_parallel_logprobs, vocab_parallel_logprobs_and_entropy,
)
from megarlhf.rl.advantages import (
    masked_whiten, reinforce_pp_advantages, reinforce_pp_baseline_advantages,
)


def dp_advantages(data: dict, group_size: int) -> dict:
    """At DP = world size, whiten this rank's rows (rank_microbatches' contiguous share) with
    the DP group, and run REINFORCE++ (plain and baseline) with DP-global whitening."""
    mesh = init_mesh(ParallelConfig())
    per_rank = data["mask"].shape[0] // mesh.dp_size
    mine = {k: v[mesh.dp_rank * per_rank:(mesh.dp_rank + 1) * per_rank] for k, v in data.items()}
    shaping = dict(logp_BT=mine["logp"], ref_logp_BT=mine["ref_logp"], kl_coef=0.1,
                   gamma=0.9, group=mesh.dp_group)
    return {
        "whiten": masked_whiten(mine["x"], mine["mask"], group=mesh.dp_group),
        "whiten_no_shift": masked_whiten(mine["x"], mine["mask"], group=mesh.dp_group,
                                         shift_mean=False),
        "reinforce++": reinforce_pp_advantages(mine["score"], mine["mask"], **shaping),
        "reinforce++_baseline": reinforce_pp_baseline_advantages(
            mine["score"], mine["mask"], group_size=group_size, **shaping),
    }


def tp_vocab_softmax(cases: list[dict], tp: int) -> list[dict]:
    """Each case: this rank's vocabulary slice of `logits` (padded width), through the fused and
    the separate vocab-parallel functions; values and gradients w.r.t. the local slice."""
    mesh = init_mesh(ParallelConfig(tensor_parallel=tp))
    results = []
    for case in cases:
        width = case["logits"].shape[-1] // mesh.tp
        start = mesh.tp_rank * width
        kw = dict(tp_group=mesh.tp_group, vocab_start=start, vocab_size=case["vocab_size"])

        def local():
            return case["logits"][..., start:start + width].clone().requires_grad_()

        out = {}
        x = local()
        logp, entropy = vocab_parallel_logprobs_and_entropy(x, case["labels"], **kw)
        loss = (logp * case["w_logp"] + entropy * case["w_entropy"]).sum()
        (out["fused_grad"],) = torch.autograd.grad(loss, x)
        out["fused_logp"], out["fused_entropy"] = logp.detach(), entropy.detach()

        x = local()
        entropy = vocab_parallel_entropy(x, **kw)
        (out["entropy_grad"],) = torch.autograd.grad((entropy * case["w_entropy"]).sum(), x)
        out["entropy"] = entropy.detach()

        x = local()
        logp = vocab_parallel_logprobs(x, case["labels"], **kw)
        (out["logp_grad"],) = torch.autograd.grad((logp * case["w_logp"]).sum(), x)
        out["logp"] = logp.detach()
        results.append(out)
    return results
