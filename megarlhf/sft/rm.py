"""Stage 2: a pairwise reward model. Loss -logsigmoid(s_chosen - s_rejected - margin), with
s the value head's output at a sequence's last real token (as ValueRole.scores reads it in
PPO); accuracy = share of pairs with s_chosen > s_rejected (ties count as wrong)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from megarlhf.data.pairs import pair_batch
from megarlhf.sft import loop
from megarlhf.sft.config import RMConfig


def pairwise_loss(mb, values_BT: torch.Tensor):
    """Loss closure: chosen on even rows, rejected on odd rows (data.pairs); the loss sum is
    over pairs, so the engine's token-mean is the mean over the global batch's pairs."""
    values_BT = values_BT.float()
    score_B = values_BT[torch.arange(values_BT.shape[0]), mb["last_index"]]
    chosen, rejected = score_B[0::2], score_B[1::2]
    weight = mb["pair_weight"][0::2]
    loss_sum = (-F.logsigmoid(chosen - rejected - mb["margin"][0::2]) * weight).sum()
    pairs = weight.sum().to(torch.int)
    return loss_sum, pairs, {
        "loss_sum": loss_sum.detach().clone(), "num_tokens": pairs.detach().clone(),
        "correct": ((chosen > rejected).float() * weight).sum().detach(),
        "chosen_sum": (chosen * weight).sum().detach(),
        "rejected_sum": (rejected * weight).sum().detach(),
    }


def rm_metrics(sums: dict[str, float]) -> dict[str, float]:
    pairs = max(sums["num_tokens"], 1.0)
    return {"loss": sums["loss_sum"] / pairs, "accuracy": sums["correct"] / pairs,
            "chosen_score": sums["chosen_sum"] / pairs,
            "rejected_score": sums["rejected_sum"] / pairs, "pairs": int(sums["num_tokens"])}


def rm_stage(cfg: RMConfig, pad_id: int) -> loop.Stage:
    return loop.Stage(
        name="rm", kind="pairwise", value_head=True, rows_per_item=2,
        row_tokens=cfg.data.max_length, arrange=list,
        to_batch=functools.partial(pair_batch, pad_id=pad_id), filler_key="pair_weight",
        loss_fn=lambda mesh, model: pairwise_loss, metrics=rm_metrics,
        default_margin=cfg.margin)


def run_rm(cfg: RMConfig) -> dict:
    """Train the reward model on this rank (call on every rank: torchrun, srun, launch_local)."""
    return loop.run(cfg, functools.partial(rm_stage, cfg))
