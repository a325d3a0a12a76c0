"""Offline preference optimization: DPO, IPO and SimPO on prompt + chosen + rejected pairs,
KTO on unpaired prompt + completion + label rows.

Pairs are laid out as the reward model's (data/pairs.py: chosen on even rows, rejected on odd
ones, so every micro-batch and DP share holds whole pairs). A row's logprob is the sum of
log p(token) over its response tokens, from the vocabulary-parallel logprobs of the labels.
The reference's row logprobs ride in the micro-batch as `ref_logp`: computed on the same
micro-batches just before each step and evaluation (`dpo.reference: live`), or once for the
whole dataset before the first step and carried by the examples (`cached`); SimPO has none.
The reference is a frozen copy of the starting model, or with LoRA the trained model itself
with its adapters off.

Per pair, with p the policy's and r the reference's row logprobs, n the response lengths,
b = beta, e = label_smoothing:

    dpo    h = (p_c - r_c) - (p_r - r_r)             loss = -(1-e) ls(b h) - e ls(-b h)
    ipo    h = (p_c - r_c)/n_c - (p_r - r_r)/n_r     loss = (h - 1/(2 b))^2
    simpo  h = p_c/n_c - p_r/n_r                     loss = -(1-e) ls(b h - g) - e ls(g - b h)

(ls = log sigmoid, g = gamma), plus sft_weight x (-p_c/n_c). The implicit rewards logged are
b (p - r) per response (b (p - r)/n for IPO, b p/n for SimPO: the per-token means their
losses compare); accuracy is the share of pairs whose chosen reward is the larger. Losses
are summed over pairs and the engine divides by the global pair count.

KTO: each row i also has a mismatched row, its prompt with row i-1's completion (the first
row takes the last row's; the global batch's order, so the estimate does not depend on the
layout). Before the step, the policy and the reference score the mismatched rows (forward
only: no gradient, and no LoRA dropout, so z is deterministic); z = max(0, mean over the global
batch of their log-ratio) is the same constant for every row, and with w_d, w_u the row
weights

    desirable    loss = w_d (1 - sigmoid(b (r - z)))
    undesirable  loss = w_u (1 - sigmoid(b (z - r)))          r = p - r_ref

averaged over rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import os
import time
import weakref

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megarlhf.data.dataset import Examples
from megarlhf.data.encode import Example
from megarlhf.data.packing import pack
from megarlhf.data.pairs import (packed_pair_batch, pair_inputs, pair_length, pair_sequences,
                                 row_sequences)
from megarlhf.engine.losses import token_logprobs
from megarlhf.engine.schedule import Batch, Loss, pad_to_multiple
from megarlhf.engine.train import TrainEngine
from megarlhf.models.config import ModelConfig
from megarlhf.models.lora import adapters_off
from megarlhf.parallel.mesh import Mesh
from megarlhf.sft import loop
from megarlhf.sft.config import DPOConfig, DPOSettings
from megarlhf.sft.model import init_weights, new_engine


def dpo_batch(pairs: list[Example], pad_id: int) -> Batch:
    """The reward model's pair batch plus `label_mask`: 1 where the label is a response
    token (the position before it reads it)."""
    sequences = pair_sequences(pairs, pad_id)
    return {**pair_inputs(pairs, sequences), "label_mask": _label_mask(sequences)}


KL_PREFIX = "kl_"


def kto_batch(rows: list[Example], pad_id: int, max_length: int) -> Batch:
    """Unpaired rows: model inputs, `label_mask`, `row_weight` (1; 0 on filler rows) and
    `desirable` (1/0); and under KL_PREFIX the same inputs for each row's prompt with the
    previous row's completion (cut to `max_length`)."""
    own = [(ex.prompt, ex.responses[0]) for ex in rows]
    shifted = [(prompt, rows[i - 1].responses[0][:max_length - len(prompt)])
               for i, (prompt, _) in enumerate(own)]
    real, kl = row_sequences(own, pad_id), row_sequences(shifted, pad_id)
    return {**real.model_inputs(), "label_mask": _label_mask(real),
            "row_weight": torch.ones(len(rows)),
            "desirable": torch.tensor([float(ex.label) for ex in rows]),
            **{KL_PREFIX + k: v for k, v in
               {**kl.model_inputs(), "label_mask": _label_mask(kl)}.items()}}


def _label_mask(sequences) -> torch.Tensor:
    """1 where the label is a response token (the position before it reads it)."""
    response = sequences.response_mask
    return torch.cat([response[:, 1:], torch.zeros_like(response[:, :1])], dim=1).float()


def _sequence_logps(batch: Batch, logp_BT: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's response logprob (sum) and response length, flat: one per row, or
    with packed pairs (`pair_weight` [B, D]) one per row and document slot, row-major (a
    slot no document fills counts 0 tokens)."""
    masked = logp_BT.float() * batch["label_mask"]
    weight = batch.get("pair_weight")
    if weight is None or weight.dim() == 1:
        return masked.sum(1), batch["label_mask"].sum(1)
    B, D = batch["pair_weight"].shape
    doc = batch["document_ids"]
    slot = torch.where(doc >= 0, doc, D)  # padding into a slot of its own, dropped below
    sums = torch.zeros(B, D + 1, dtype=masked.dtype, device=masked.device)
    counts = torch.zeros_like(sums)
    sums.scatter_add_(1, slot, masked)
    counts.scatter_add_(1, slot, batch["label_mask"].to(counts.dtype))
    return sums[:, :D].flatten(), counts[:, :D].flatten()


def preference_loss(settings: DPOSettings, batch: Batch, logp_BT: torch.Tensor):
    """The loss closure (module docstring), over this micro-batch's pairs."""
    logp, length = _sequence_logps(batch, logp_BT)
    length = length.clamp(min=1)  # empty slots of packed rows (weight 0)
    weight = batch["pair_weight"].flatten()[0::2]
    b, e = settings.temperature, settings.label_smoothing
    ratio = logp - batch["ref_logp"].flatten() if settings.needs_reference else logp
    if settings.loss != "dpo":
        # IPO and SimPO compare per-token means; the logged rewards and accuracy come from
        # the same ratios, so they describe the gap the loss pushes on.
        ratio = ratio / length
    reward = b * ratio
    chosen, rejected = ratio[0::2], ratio[1::2]
    if settings.loss == "dpo":
        h = b * (chosen - rejected)
        per_pair = -(1 - e) * F.logsigmoid(h) - e * F.logsigmoid(-h)
    elif settings.loss == "ipo":
        h = chosen - rejected
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


def kto_loss(settings: DPOSettings, batch: Batch, logp_BT: torch.Tensor):
    """The KTO closure (module docstring), over this micro-batch's rows."""
    logp, _ = _sequence_logps(batch, logp_BT)
    weight, good = batch["row_weight"], batch["desirable"]
    b, z = settings.temperature, batch["kl"]
    ratio = logp - batch["ref_logp"]
    per_row = (good * settings.desirable_weight * (1 - torch.sigmoid(b * (ratio - z)))
               + (1 - good) * settings.undesirable_weight * (1 - torch.sigmoid(b * (z - ratio))))
    loss_sum = (per_row * weight).sum()
    rows = weight.sum().to(torch.int)
    good_w, bad_w = good * weight, (1 - good) * weight
    return loss_sum, rows, {
        "loss_sum": loss_sum.detach().clone(), "num_tokens": rows.detach().clone(),
        "kl_sum": (z * weight).sum().detach(), "desirable": good_w.sum().detach(),
        "chosen_reward_sum": (b * ratio * good_w).sum().detach(),
        "rejected_reward_sum": (b * ratio * bad_w).sum().detach(),
        "chosen_logp_sum": (logp * good_w).sum().detach(),
        "rejected_logp_sum": (logp * bad_w).sum().detach(),
    }


def kto_metrics(sums: dict[str, float]) -> dict[str, float]:
    """Rewards and logprobs are means over the desirable (chosen_*) and undesirable
    (rejected_*) rows."""
    rows = max(sums["num_tokens"], 1.0)
    good, bad = max(sums["desirable"], 1.0), max(sums["num_tokens"] - sums["desirable"], 1.0)
    chosen, rejected = sums["chosen_reward_sum"] / good, sums["rejected_reward_sum"] / bad
    return {"loss": sums["loss_sum"] / rows, "kl": sums["kl_sum"] / rows,
            "reward_margin": chosen - rejected, "chosen_reward": chosen,
            "rejected_reward": rejected, "chosen_logp": sums["chosen_logp_sum"] / good,
            "rejected_logp": sums["rejected_logp_sum"] / bad, "rows": int(sums["num_tokens"]),
            "desirable": int(sums["desirable"])}


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


def _row_closure(batch: Batch, logp_BT: torch.Tensor):
    """Each sequence's response logprob, and (where rows are weighted) their weighted sum."""
    logp, _ = _sequence_logps(batch, logp_BT)
    out = {"row_logp": logp.detach()}
    if "row_weight" in batch:
        out["logp_sum"] = (logp * batch["row_weight"]).sum().detach()
        out["rows"] = batch["row_weight"].sum().detach()
    return logp.sum() * 0, torch.zeros((), dtype=torch.int), out


def _reference(cfg: DPOConfig, mesh: Mesh, model: ModelConfig, engine: TrainEngine):
    """The reference engine and the context it scores under: a frozen engine loading the
    starting weights (built after the trained engine, so a resumed run's reference is still
    the starting model, not the resumed weights), or with LoRA the trained engine with its
    adapters off."""
    if cfg.model.lora is not None:
        return engine, lambda: adapters_off(engine.chunks)
    ref = new_engine(cfg.model, model, cfg.parallel, mesh, None, value_head=False)
    init_weights(cfg.model, ref)
    return ref, contextlib.nullcontext


def reference(cfg: DPOConfig, mesh: Mesh, model: ModelConfig, engine: TrainEngine):
    """The annotator (loop.Stage.annotator) of `dpo.reference: live`: puts the reference's
    row logprobs into each micro-batch as `ref_logp`, and for KTO the KL estimate as `kl`."""
    ref, as_reference = _reference(cfg, mesh, model, engine)
    loss = Loss(closure=_row_closure, per_position=_logprobs(mesh, model))

    def kl_estimate(microbatches: list[Batch]) -> float:
        views = [pad_to_multiple({**{k[len(KL_PREFIX):]: v for k, v in mb.items()
                                     if k.startswith(KL_PREFIX)},
                                  "row_weight": mb["row_weight"]},
                                 cfg.parallel.sequence_multiple) for mb in microbatches]
        policy = engine.global_sums(engine.forward(views, loss))
        with as_reference():
            frozen = ref.global_sums(ref.forward(views, loss))
        return max(0.0, (policy["logp_sum"] - frozen["logp_sum"]) / max(policy["rows"], 1.0))

    def annotate(microbatches: list[Batch]) -> None:
        with as_reference():
            out = ref.forward(microbatches, loss)
        for mb, o in zip(microbatches, out):
            shape = mb["pair_weight"].shape if "pair_weight" in mb else (-1,)
            mb["ref_logp"] = o["row_logp"].reshape(shape).to(mb["tokens"].device)
        if cfg.dpo.loss == "kto":
            z = kl_estimate(microbatches)
            for mb in microbatches:
                for key in [k for k in mb if k.startswith(KL_PREFIX)]:
                    del mb[key]  # scored; the step need not carry them
                mb["kl"] = torch.full_like(mb["row_weight"], z)

    return annotate


def cache_reference(cfg: DPOConfig, pad_id: int, mesh: Mesh, model: ModelConfig,
                    engine: TrainEngine, examples: Examples) -> tuple[Examples, dict]:
    """The prepare hook (loop.Stage.prepare) of `dpo.reference: cached`: every training and
    evaluation pair with its two reference logprobs (`Example.ref_logps`), scored in global
    batches of train.global_batch_size pairs, one pair per two rows, each DP rank scoring its
    share and the shares summed over the DP group (each position is one rank's value plus
    zeros, so exact); then the frozen reference is dropped."""
    t0 = time.perf_counter()
    ref, as_reference = _reference(cfg, mesh, model, engine)
    frozen_bytes = 0 if ref is engine else sum(
        p.numel() * p.element_size() for chunk in ref.chunks for p in chunk.parameters())
    loss = Loss(closure=_row_closure, per_position=_logprobs(mesh, model))
    size = cfg.train.global_batch_size
    # Each row is scored alone, so rows need not stay paired: one row always fits the budget
    # (packed training rows bound it by one row of 2 x max_length, not two of max_length).
    to_microbatches = loop.split(cfg, 1, mesh)

    def scored(ref: TrainEngine, pairs: list[Example]) -> list[Example]:
        out = []
        for start in range(0, len(pairs), size):
            chunk = pairs[start:start + size]
            batch = dpo_batch(chunk + [chunk[-1]] * (size - len(chunk)), pad_id)
            rows, microbatches = zip(*to_microbatches.with_rows(batch))
            with as_reference():
                logps = ref.forward(list(microbatches), loss)
            total = torch.zeros(2 * size, device=logps[0]["row_logp"].device)
            for r, o in zip(rows, logps):
                total[r.to(total.device)] = o["row_logp"]
            dist.all_reduce(total, group=mesh.dp_group)
            values = total.tolist()
            out += [dataclasses.replace(ex, ref_logps=(values[2 * i], values[2 * i + 1]))
                    for i, ex in enumerate(chunk)]
        return out

    cached = dataclasses.replace(examples, train=scored(ref, examples.train),
                                 eval=scored(ref, examples.eval))
    # The frozen engine's weights go now (the trained engine's stay: LoRA's base); counted as
    # freed only once the engine is really collected (nothing else holds it).
    collected = None if ref is engine else weakref.ref(ref.chunks[0])
    del ref
    gc.collect()
    if collected is not None and collected() is not None:
        frozen_bytes = 0
    seconds = round(time.perf_counter() - t0, 2)
    pairs = len(cached.train) + len(cached.eval)
    freed = (f"its weights ({frozen_bytes / 2**20:.1f} MiB on this rank) freed for training"
             if frozen_bytes else "no weights freed (with LoRA the reference is the trained "
             "model's base)" if collected is None else "its weights are still referenced")
    return cached, {
        "reference": "cached", "pairs": pairs, "seconds": seconds,
        "cache_bytes": 2 * pairs * 4, "reference_bytes_freed": frozen_bytes,
        "summary": f"reference logprobs of {pairs} pairs cached in {seconds} s "
                   f"({2 * pairs * 4 / 2**10:.1f} KiB as fp32); {freed}"}


def dpo_stage(cfg: DPOConfig, pad_id: int) -> loop.Stage:
    settings = cfg.dpo
    if settings.loss == "kto":
        layout = dict(kind="unpaired", rows_per_item=1, filler_key="row_weight", arrange=list,
                      to_batch=functools.partial(kto_batch, pad_id=pad_id,
                                                 max_length=cfg.data.max_length),
                      closure=kto_loss, metrics=kto_metrics)
    elif cfg.pack:
        layout = dict(kind="pairwise", rows_per_item=1, filler_key="pair_weight",
                      arrange=functools.partial(pack, row_length=2 * cfg.data.max_length,
                                                length=pair_length),
                      to_batch=functools.partial(packed_pair_batch, pad_id=pad_id),
                      closure=preference_loss, metrics=dpo_metrics)
    else:
        layout = dict(kind="pairwise", rows_per_item=2, filler_key="pair_weight", arrange=list,
                      to_batch=functools.partial(dpo_batch, pad_id=pad_id),
                      closure=preference_loss, metrics=dpo_metrics)
    closure = functools.partial(layout.pop("closure"), settings)
    return loop.Stage(
        name="dpo", value_head=False, **layout,
        row_tokens=cfg.data.max_length * (2 if cfg.pack else 1),
        loss_fn=lambda mesh, model: Loss(closure=closure, per_position=_logprobs(mesh, model)),
        # Stream items are rows when packing (pairs otherwise); earlier runs had no field.
        fingerprint={"dpo": settings.fingerprint(), **({"pack": True} if cfg.pack else {}),
                     "reference": os.path.abspath(cfg.model.checkpoint)},
        annotator=(functools.partial(reference, cfg)
                   if settings.needs_reference and settings.reference == "live" else None),
        prepare=(functools.partial(cache_reference, cfg, pad_id)
                 if settings.reference == "cached" else None))


def run_dpo(cfg: DPOConfig) -> dict:
    """Preference optimization on this rank (call on every rank: torchrun, srun,
    launch_local)."""
    return loop.run(cfg, functools.partial(dpo_stage, cfg))
