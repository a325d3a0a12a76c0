"""Offline preference optimization on prompt + chosen + rejected pairs: DPO, IPO and SimPO.

Rows are laid out as the reward model's (data/pairs.py: chosen on even rows, rejected on odd
ones, so every micro-batch and DP share holds whole pairs). A row's logprob is the sum of
log p(token) over its response tokens, from the vocabulary-parallel logprobs of the labels
(context parallelism gathers those, not the logits). The reference's row logprobs are
computed on the same micro-batches by a frozen copy of the starting model just before each
step (and each evaluation) and ride in the micro-batch as `ref_logp`; SimPO has none.

Per pair, with p the policy's and r the reference's row logprobs, n the response lengths,
b = beta, e = label_smoothing:

    dpo    h = (p_c - r_c) - (p_r - r_r)             loss = -(1-e) ls(b h) - e ls(-b h)
    ipo    h = (p_c - r_c)/n_c - (p_r - r_r)/n_r     loss = (h - 1/(2 b))^2
    simpo  h = p_c/n_c - p_r/n_r                     loss = -(1-e) ls(b h - g) - e ls(g - b h)

(ls = log sigmoid, g = gamma), plus sft_weight x (-p_c/n_c). The implicit rewards logged are
b (p - r) per response (b p/n for SimPO); accuracy is the share of pairs whose chosen reward
is the larger. Losses are summed over pairs and the engine divides by the global pair count.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import torch
import torch.nn.functional as F

from megarlhf.data.encode import Example
from megarlhf.data.pairs import pair_inputs, pair_sequences
from megarlhf.engine.losses import token_logprobs
from megarlhf.engine.schedule import Batch, Loss
from megarlhf.models.config import ModelConfig
from megarlhf.parallel.mesh import Mesh
from megarlhf.sft import loop
from megarlhf.sft.config import DPOConfig, DPOSettings
from megarlhf.sft.model import init_weights, new_engine


def dpo_batch(pairs: list[Example], pad_id: int) -> Batch:
    """The reward model's pair batch plus `label_mask`: 1 where the label is a response
    token (the position before it reads it)."""
    sequences = pair_sequences(pairs, pad_id)
    batch = pair_inputs(pairs, sequences)
    response = sequences.response_mask
    batch["label_mask"] = torch.cat([response[:, 1:], torch.zeros_like(response[:, :1])],
                                    dim=1).float()
    return batch


def _row_logps(batch: Batch, logp_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's response logprob (sum) and response length."""
    mask = batch["label_mask"]
    return (logp_BT.float() * mask).sum(1), mask.sum(1)


def preference_loss(settings: DPOSettings, batch: Batch, logp_BT: torch.Tensor):
    """The loss closure (module docstring), over this micro-batch's pairs."""
    logp, length = _row_logps(batch, logp_BT)
    weight = batch["pair_weight"][0::2]
    b, e = settings.temperature, settings.label_smoothing
    ratio = logp - batch["ref_logp"] if settings.needs_reference else logp / length
    reward = b * ratio
    chosen, rejected = ratio[0::2], ratio[1::2]
    if settings.loss == "dpo":
        h = b * (chosen - rejected)
        per_pair = -(1 - e) * F.logsigmoid(h) - e * F.logsigmoid(-h)
    elif settings.loss == "ipo":
        h = chosen / length[0::2] - rejected / length[1::2]
        per_pair = (h - 1 / (2 * b)) ** 2
    else:  # simpo
        h = b * (chosen - rejected) - settings.gamma
        per_pair = -(1 - e) * F.logsigmoid(h) - e * F.logsigmoid(-h)
    if settings.sft_weight:
        per_pair = per_pair - settings.sft_weight * logp[0::2] / length[0::2]
    loss_sum = (per_pair * weight).sum()
    pairs = weight.sum().to(torch.int)
    won = reward[0::2] > reward[1::2]
    return loss_sum, pairs, {
        "loss_sum": loss_sum.detach().clone(), "num_tokens": pairs.detach().clone(),
        "correct": (won.float() * weight).sum().detach(),
        "chosen_reward_sum": (reward[0::2] * weight).sum().detach(),
        "rejected_reward_sum": (reward[1::2] * weight).sum().detach(),
        "chosen_logp_sum": (logp[0::2] * weight).sum().detach(),
        "rejected_logp_sum": (logp[1::2] * weight).sum().detach(),
    }


def dpo_metrics(sums: dict[str, float]) -> dict[str, float]:
    pairs = max(sums["num_tokens"], 1.0)
    chosen, rejected = sums["chosen_reward_sum"] / pairs, sums["rejected_reward_sum"] / pairs
    return {"loss": sums["loss_sum"] / pairs, "reward_accuracy": sums["correct"] / pairs,
            "reward_margin": chosen - rejected, "chosen_reward": chosen,
            "rejected_reward": rejected, "chosen_logp": sums["chosen_logp_sum"] / pairs,
            "rejected_logp": sums["rejected_logp_sum"] / pairs, "pairs": int(sums["num_tokens"])}


def _logprobs(mesh: Mesh, model: ModelConfig):
    return lambda inputs, logits_BTV: token_logprobs(logits_BTV, inputs["labels"], mesh,
                                                     model.vocab_size)


def _reference_closure(batch: Batch, logp_BT: torch.Tensor):
    logp, _ = _row_logps(batch, logp_BT)
    zero = logp.sum() * 0
    return zero, torch.zeros((), dtype=torch.int), {"row_logp": logp.detach()}


def reference(cfg: DPOConfig, mesh: Mesh, model: ModelConfig):
    """The annotator (loop.Stage.annotator): a frozen engine holding the starting weights,
    whose row logprobs go into each micro-batch as `ref_logp`. Built after the trained engine,
    so a resumed run's reference is still the starting model, not the resumed weights."""
    frozen = new_engine(cfg.model, model, cfg.parallel, mesh, None, value_head=False)
    init_weights(cfg.model, frozen)
    loss = Loss(closure=_reference_closure, per_position=_logprobs(mesh, model))

    def annotate(microbatches: list[Batch]) -> None:
        out = frozen.forward(microbatches, loss)
        for mb, o in zip(microbatches, out):
            mb["ref_logp"] = o["row_logp"].to(mb["tokens"].device)

    return annotate


def dpo_stage(cfg: DPOConfig, pad_id: int) -> loop.Stage:
    settings = cfg.dpo
    return loop.Stage(
        name="dpo", kind="pairwise", value_head=False, rows_per_item=2, arrange=list,
        to_batch=functools.partial(dpo_batch, pad_id=pad_id), filler_key="pair_weight",
        loss_fn=lambda mesh, model: Loss(closure=functools.partial(preference_loss, settings),
                                         per_position=_logprobs(mesh, model)),
        metrics=dpo_metrics,
        fingerprint={"dpo": dataclasses.asdict(settings),
                     "reference": os.path.abspath(cfg.model.checkpoint)},
        annotator=functools.partial(reference, cfg) if settings.needs_reference else None)


def run_dpo(cfg: DPOConfig) -> dict:
    """Preference optimization on this rank (call on every rank: torchrun, srun,
    launch_local)."""
    return loop.run(cfg, functools.partial(dpo_stage, cfg))
