"""Offline preference optimization (`megarlhf dpo`): the losses against a reference written
from the papers' formulas (KTO from TRL's), and (slow) whole runs: the first step's loss where
the policy is still its reference (DPO: ln 2, IPO: 1/(4 beta^2), KTO: 1/2, exactly), learning
on warm-vs-cold pairs, TP2 x PP2 against TP1, packed pairs at CP2 against unpacked ones at
TP1, KTO at DP2 against DP1 (its KL estimate spans the global batch), LoRA (the reference is
the base), a resume split at step 2 against a
straight run (the resumed run's reference is the starting model, not the resumed weights),
and the command line (SimPO, two DP ranks, HF export).

Tolerances as in tests/test_sft_rm.py: layouts change only fp32 summation order, so over a
few Adam steps metrics stay within 1e-5 relative; a pair split across micro-batches or a
reference that moved changes them by far more.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
import yaml

from megarlhf.configio import to_dict
from megarlhf.data import synthetic
from megarlhf.data.config import DataConfig, DatasetSource
from megarlhf.data.encode import Example
from megarlhf.data.tokenizer import train_sentencepiece
from megarlhf.engine.optim import OptimConfig
from megarlhf.metrics import read_metrics
from megarlhf.parallel import launch_local
from megarlhf.parallel.mesh import ParallelConfig as P
from megarlhf.sft.config import DPOConfig, DPOSettings, LoopConfig, ModelSource
from megarlhf.data.pairs import packed_pair_batch
from megarlhf.models.lora import LoraConfig
from tests import workers
from megarlhf.sft.dpo import (KL_PREFIX, dpo_batch, dpo_metrics, kto_batch, kto_loss,
                              kto_metrics, preference_loss, run_dpo)

REL = 1e-5
OPTIM = OptimConfig(lr=3e-4, weight_decay=0.0, clip_grad=1.0, adam_eps=1e-6)


# -- the losses (fast) --

def _reference_losses(settings: DPOSettings, logits_BTV, pairs, ref_logp_B):
    """Per pair, from full-vocabulary log-softmax and explicit loops over response tokens."""
    b, e, g = settings.temperature, settings.label_smoothing, settings.gamma
    logp, n = [], []
    rows = [(ex.prompt, r) for ex in pairs for r in ex.responses]
    for i, (prompt, resp) in enumerate(rows):
        seq = prompt + resp
        logprobs = torch.log_softmax(logits_BTV[i].double(), dim=-1)
        logp.append(sum(logprobs[t - 1, seq[t]] for t in range(len(prompt), len(seq))))
        n.append(len(resp))
    out = []
    for k in range(len(pairs)):
        c, r = 2 * k, 2 * k + 1
        rc, rr = float(ref_logp_B[c]), float(ref_logp_B[r])
        if settings.loss == "dpo":
            h = b * ((logp[c] - rc) - (logp[r] - rr))
            loss = -(1 - e) * F.logsigmoid(h) - e * F.logsigmoid(-h)
        elif settings.loss == "ipo":
            h = (logp[c] - rc) / n[c] - (logp[r] - rr) / n[r]
            loss = (h - 1 / (2 * b)) ** 2
        else:
            h = b * (logp[c] / n[c] - logp[r] / n[r]) - g
            loss = -(1 - e) * F.logsigmoid(h) - e * F.logsigmoid(-h)
        out.append(loss - settings.sft_weight * logp[c] / n[c])
    return torch.stack(out)


@pytest.mark.parametrize("settings", [
    DPOSettings(), DPOSettings(loss="dpo", beta=0.5, label_smoothing=0.2, sft_weight=0.3),
    DPOSettings(loss="ipo", beta=0.3), DPOSettings(loss="simpo"),
    DPOSettings(loss="simpo", gamma=1.0, label_smoothing=0.1)], ids=str)
def test_losses_match_the_formulas(settings):
    torch.manual_seed(0)
    pairs = [Example(prompt=[1, 2, 3], responses=([4, 5], [6, 7, 8, 9])),
             Example(prompt=[2, 3], responses=([5, 5, 5], [7]))]
    batch = dpo_batch(pairs, pad_id=0)
    logits = torch.randn(*batch["tokens"].shape, 11)
    logp_BT = torch.log_softmax(logits, -1).gather(-1, batch["labels"][..., None])[..., 0]
    batch["ref_logp"] = torch.randn(4) - 5
    loss_sum, count, sums = preference_loss(settings, batch, logp_BT)
    expected = _reference_losses(settings, logits, pairs, batch["ref_logp"])
    assert int(count) == 2
    assert float(loss_sum) == pytest.approx(float(expected.sum()), rel=1e-6)
    metrics = dpo_metrics({k: float(v) for k, v in sums.items()})
    assert metrics["loss"] == pytest.approx(float(expected.mean()), rel=1e-6)
    assert metrics["chosen_logp"] < 0 and metrics["pairs"] == 2


def test_ipo_logs_rewards_and_accuracy_of_the_per_token_ratios_its_loss_compares():
    """Two pairs with hand-picked per-token logprobs. Pair 1's chosen response is one token,
    its rejected four: by summed log-ratios chosen wins (-0.5 > -1.0), by per-token means
    (IPO's) it loses (-0.5 < -0.25). DPO, on the same batch, keeps the summed ones."""
    pairs = [Example(prompt=[1, 2], responses=([3], [4, 5, 6, 7])),
             Example(prompt=[3], responses=([4, 5], [6, 7, 8]))]
    token_logps = [[-1.0], [-0.2, -0.4, -0.6, -0.8], [-0.3, -0.5], [-0.9, -1.1, -1.0]]
    batch = dpo_batch(pairs, pad_id=0)
    batch["ref_logp"] = torch.tensor([-0.5, -1.0, -1.2, -2.4])
    logp_BT = torch.full(batch["tokens"].shape, -7.0)  # prompt and padding: must not count
    for row, values in enumerate(token_logps):
        logp_BT[row, batch["label_mask"][row].bool()] = torch.tensor(values)

    def logged(settings):
        _, _, sums = preference_loss(settings, batch, logp_BT)
        return dpo_metrics({k: float(v) for k, v in sums.items()})

    # Per-token log-ratios (p - r)/n: pair 1 chosen (-1.0 + 0.5)/1 = -0.5, rejected
    # (-2.0 + 1.0)/4 = -0.25; pair 2 chosen (-0.8 + 1.2)/2 = 0.2, rejected (-3.0 + 2.4)/3 = -0.2.
    ipo = logged(DPOSettings(loss="ipo", beta=0.5))
    assert ipo["chosen_reward"] == pytest.approx(0.5 * (-0.5 + 0.2) / 2, rel=1e-6)
    assert ipo["rejected_reward"] == pytest.approx(0.5 * (-0.25 - 0.2) / 2, rel=1e-6)
    assert ipo["reward_margin"] == pytest.approx(0.5 * ((-0.5 + 0.25) + (0.2 + 0.2)) / 2,
                                                 rel=1e-5)
    assert ipo["reward_accuracy"] == 0.5
    # (h - 1/(2 beta))^2 with h = -0.5 + 0.25 and 0.2 + 0.2.
    assert ipo["loss"] == pytest.approx(((-0.25 - 1) ** 2 + (0.4 - 1) ** 2) / 2, rel=1e-6)
    # Summed log-ratios p - r: chosen -0.5 and 0.4, rejected -1.0 and -0.6.
    dpo = logged(DPOSettings(loss="dpo", beta=0.5))
    assert dpo["chosen_reward"] == pytest.approx(0.5 * (-0.5 + 0.4) / 2, rel=1e-6)
    assert dpo["rejected_reward"] == pytest.approx(0.5 * (-1.0 - 0.6) / 2, rel=1e-6)
    assert dpo["reward_accuracy"] == 1.0


def test_kto_matches_its_formula_and_pairs_each_prompt_with_the_previous_completion():
    torch.manual_seed(0)
    rows = [Example(prompt=(1, 2, 3), responses=((4, 5),), label=True),
            Example(prompt=(2,), responses=((6, 7, 8, 9),), label=False),
            Example(prompt=(3, 3), responses=((5,),), label=True)]
    batch = kto_batch(rows, pad_id=0, max_length=5)
    # Row i's mismatched row: its prompt, row i-1's completion, cut to max_length=5.
    kl_tokens = batch[KL_PREFIX + "tokens"]
    assert kl_tokens[0].tolist() == [1, 2, 3, 5, 0]
    assert kl_tokens[1].tolist() == [2, 4, 5, 0, 0]
    assert kl_tokens[2].tolist() == [3, 3, 6, 7, 8]
    assert batch[KL_PREFIX + "label_mask"][2].tolist() == [0, 1, 1, 1, 0]
    settings = DPOSettings(loss="kto", beta=0.5, desirable_weight=1.5, undesirable_weight=0.7)
    logits = torch.randn(*batch["tokens"].shape, 11)
    logp_BT = torch.log_softmax(logits, -1).gather(-1, batch["labels"][..., None])[..., 0]
    batch["ref_logp"] = torch.randn(3) - 4
    batch["kl"] = torch.full((3,), 0.3)
    loss_sum, count, sums = kto_loss(settings, batch, logp_BT)
    expected = []
    for i, ex in enumerate(rows):  # TRL's KTO loss, written out per row
        seq = ex.prompt + ex.responses[0]
        lp = torch.log_softmax(logits[i].double(), -1)
        logp = sum(lp[t - 1, seq[t]] for t in range(len(ex.prompt), len(seq)))
        r = logp - float(batch["ref_logp"][i])
        if ex.label:
            expected.append(1.5 * (1 - torch.sigmoid(0.5 * (r - 0.3))))
        else:
            expected.append(0.7 * (1 - torch.sigmoid(0.5 * (0.3 - r))))
    assert int(count) == 3
    assert float(loss_sum) == pytest.approx(float(sum(expected)), rel=1e-6)
    metrics = kto_metrics({k: float(v) for k, v in sums.items()})
    assert metrics["kl"] == pytest.approx(0.3) and metrics["desirable"] == 2
    assert metrics["loss"] == pytest.approx(float(sum(expected)) / 3, rel=1e-6)


def test_a_packed_batch_scores_each_pair_as_the_unpacked_one():
    """Also with cached reference logprobs (dpo.reference: cached), which the examples carry
    into both layouts."""
    pairs = [Example(prompt=(1, 2, 3), responses=((4, 5), (6, 7, 8, 9)), ref_logps=(-3, -4)),
             Example(prompt=(2, 3), responses=((5, 5, 5), (7,)), ref_logps=(-2, -1)),
             Example(prompt=(4,), responses=((8, 9), (9, 8, 7)), ref_logps=(-5, -6))]
    flat = dpo_batch(pairs, pad_id=0)
    packed = packed_pair_batch([pairs[:2], pairs[2:]], pad_id=0)
    assert packed["pair_weight"].tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert flat["ref_logp"].tolist() == [-3, -4, -2, -1, -5, -6]
    assert packed["ref_logp"].tolist() == [[-3, -4, -2, -1], [-5, -6, 0, 0]]

    def logp(batch):  # any function of a position's own document: its label and position
        return -(batch["labels"] * 0.3 + batch["position_ids"] * 0.07 + 0.1)

    for settings in (DPOSettings(), DPOSettings(loss="ipo"), DPOSettings(loss="simpo")):
        one, n_one, sums_one = preference_loss(settings, flat, logp(flat))
        two, n_two, sums_two = preference_loss(settings, packed, logp(packed))
        assert int(n_one) == int(n_two) == 3
        assert float(two) == pytest.approx(float(one), rel=1e-6)
        for key in sums_one:
            assert float(sums_two[key]) == pytest.approx(float(sums_one[key]), rel=1e-6), key


def test_filler_pairs_count_for_nothing():
    pairs = [Example(prompt=[1, 2], responses=([3], [4, 5]))] * 2
    batch = dpo_batch(pairs, pad_id=0)
    batch["ref_logp"] = torch.zeros(4)
    batch["pair_weight"][2:] = 0
    logp_BT = -torch.rand(batch["tokens"].shape)
    logp_BT[2:] = logp_BT[:2]  # the second pair is the first again
    one, count, _ = preference_loss(DPOSettings(), batch, logp_BT)
    batch["pair_weight"][2:] = 1
    two, _, _ = preference_loss(DPOSettings(), batch, logp_BT)
    assert int(count) == 1 and float(two) == pytest.approx(2 * float(one))


def _random_rows(n: int, seed: int) -> list[Example]:
    """Pairs (or KTO rows) with prompts of 1-12 and responses of 1-20 tokens."""
    rng = random.Random(seed)
    seq = lambda lo, hi: tuple(rng.randrange(1, 50) for _ in range(rng.randint(lo, hi)))  # noqa
    return [Example(prompt=seq(1, 12), responses=(seq(1, 20), seq(1, 20))) for _ in range(n)]


@pytest.mark.parametrize("loss", ["dpo", "kto"])
def test_a_token_budget_keeps_items_whole_within_it_and_takes_every_row_once(loss):
    """Two DP ranks, CP2's multiple of 4, a budget of 64: every row goes to exactly one
    micro-batch of one rank, a pair's two rows together; each micro-batch is the rows'
    tensors cut to the columns they use (nothing real cut, width a multiple of 4, rows x
    width within the budget), KTO's mismatched rows to their own widths; the ranks' padded
    tokens differ by at most the longest item; short items share micro-batches."""
    from megarlhf.sft.microbatches import Split

    rows = _random_rows(16, seed=3)
    if loss == "kto":
        rows = [dataclasses.replace(ex, responses=ex.responses[:1], label=i % 2 == 0)
                for i, ex in enumerate(rows)]
        batch, n = kto_batch(rows, pad_id=0, max_length=32), 1
    else:
        batch, n = dpo_batch(rows, pad_id=0), 2
    batch["ref_logp"] = torch.arange(float(batch["tokens"].shape[0]))
    seen, loads, sizes = [], [], []
    for rank in range(2):
        split = Split(dp_size=2, dp_rank=rank, rows_per_item=n, multiple=4, max_tokens=64)
        load = 0
        for index, mb in split.with_rows(batch):
            seen += index.tolist()
            assert index.view(-1, n)[:, 0].remainder(n).eq(0).all()  # items whole, in order
            assert (index.view(-1, n) - index.view(-1, n)[:, :1]).eq(torch.arange(n)).all()
            for prefix in ["", KL_PREFIX] if loss == "kto" else [""]:
                doc = batch[prefix + "document_ids"][index]
                width = mb[prefix + "tokens"].shape[1]
                real = int((doc >= 0).nonzero()[:, 1].max()) + 1
                assert real <= width < real + (4 if prefix == "" else 1)
                for key in ("tokens", "labels", "position_ids"):
                    assert torch.equal(mb[prefix + key][:, :real], batch[prefix + key][index,
                                                                                      :real])
            assert len(index) * mb["tokens"].shape[1] <= 64
            assert torch.equal(mb["ref_logp"], batch["ref_logp"][index])
            load += len(index) * mb["tokens"].shape[1]
            sizes.append(len(index) // n)
        loads.append(load)
    assert sorted(seen) == list(range(batch["tokens"].shape[0]))
    assert abs(loads[0] - loads[1]) <= 64 and max(sizes) > 1
    with pytest.raises(ValueError, match="train.max_tokens_per_micro_batch=8 cannot hold"):
        Split(dp_size=2, dp_rank=0, rows_per_item=n, multiple=4, max_tokens=8)(batch)


@pytest.mark.parametrize("fields, match", [
    ({"dpo": {"loss": "orpo"}}, "dpo.loss='orpo'"),
    ({"dpo": {"loss": "kto", "sft_weight": 0.1}}, "not kto"),
    ({"dpo": {"loss": "kto", "desirable_weight": 0}}, "dpo.desirable_weight=0.0 must be > 0"),
    ({"dpo": {"undesirable_weight": 2}}, "dpo.undesirable_weight applies to kto, not dpo"),
    ({"dpo": {"loss": "kto"}, "pack": True}, "pack applies to the pair losses"),
    ({"dpo": {"loss": "kto"}, "train": {"output_dir": "o", "steps": 1,
                                        "global_batch_size": 1}}, "global_batch_size >= 2"),
    ({"dpo": {"loss": "kto"}, "data": {"train": {"path": "x.jsonl",
                                                 "fields": {"chosen": "c"}}}},
     "fields ['chosen'] are not fields of unpaired records"),
    ({"dpo": {"beta": 0}}, "dpo.beta=0"),
    ({"dpo": {"loss": "ipo", "label_smoothing": 0.1}}, "not ipo"),
    ({"dpo": {"label_smoothing": 0.5}}, "must be in [0, 0.5)"),
    ({"model": {"preset": "tiny"}}, "model.checkpoint is required"),
    ({"dpo": {"reference": "disk"}}, "dpo.reference='disk': choose one of live, cached"),
    ({"dpo": {"loss": "simpo", "reference": "cached"}}, "simpo has no reference"),
    ({"dpo": {"loss": "kto", "reference": "cached"}}, "its reference must be live"),
])
def test_config_errors_name_the_field(fields, match):
    from megarlhf.configio import from_dict

    recipe = {"model": {"checkpoint": "c"}, "data": {"train": {"path": "x.jsonl"}},
              "train": {"output_dir": "out", "steps": 1, "global_batch_size": 2}}
    with pytest.raises(ValueError, match=match.replace("[", r"\[").replace(")", r"\)")):
        from_dict(DPOConfig, {**recipe, **fields}, where="dpo.yaml")


def test_a_resume_compares_only_the_fields_its_loss_reads():
    # The fields of DPO checkpoints written before KTO existed: those runs still resume.
    assert set(DPOSettings(loss="ipo").fingerprint()) == {
        "loss", "beta", "label_smoothing", "gamma", "sft_weight"}
    assert DPOSettings(loss="kto", desirable_weight=2.0).fingerprint()["desirable_weight"] == 2
    assert DPOSettings(reference="cached").fingerprint()["reference"] == "cached"


# -- whole runs (slow) --

@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo_corpus")
    return {"sp": train_sentencepiece(synthetic.tokenizer_corpus(), str(root / "sp.model"),
                                      vocab_size=256),
            "pairs": synthetic.write_jsonl(synthetic.preference_records(200, seed=1),
                                           str(root / "pairs.jsonl")),
            "unpaired": synthetic.write_jsonl(_unpaired(synthetic.preference_records(200,
                                                                                     seed=1)),
                                              str(root / "unpaired.jsonl"))}


def _unpaired(pairs: list[dict]) -> list[dict]:
    """Each pair as two KTO rows, shuffled so desirable and undesirable rows interleave."""
    rows = [{"prompt": p["prompt"], "completion": p[key], "label": key == "chosen"}
            for p in pairs for key in ("chosen", "rejected")]
    random.Random(0).shuffle(rows)
    return rows


def dpo_config(corpus, out, ckpt, parallel=P(), settings=DPOSettings(), lora=None,
               eval_fraction=0.05, **train) -> DPOConfig:
    data = corpus["unpaired" if settings.loss == "kto" else "pairs"]
    return DPOConfig(
        model=ModelSource(checkpoint=ckpt, layer_spec="local", lora=lora),
        data=DataConfig(train=DatasetSource(path=data), tokenizer=corpus["sp"],
                        max_length=48, eval_fraction=eval_fraction),
        train=LoopConfig(output_dir=str(out), **{"steps": 6, "global_batch_size": 8,
                                                 "eval_interval": 3, **train}),
        parallel=parallel, optim=OPTIM, dpo=settings)


def _train(out: dict) -> list[dict]:
    return [r for r in out["history"] if r["split"] == "train"]


def _assert_same(a: list[dict], b: list[dict], *, bitwise: bool = False) -> None:
    assert [(r["step"], r["split"]) for r in a] == [(r["step"], r["split"]) for r in b]
    if bitwise:  # the same layout and data: the same numbers
        keys = ("loss", "grad_norm", "reward_accuracy", "reward_margin", "chosen_logp")
        assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]
    for ra, rb in zip(a, b):
        for k in ("loss", "grad_norm", "reward_accuracy", "chosen_logp", "rejected_logp"):
            if rb.get(k) is not None:
                assert ra[k] == pytest.approx(rb[k], rel=REL, abs=1e-9), (ra["step"], k)
        # Near 0 at the start: absolute.
        assert ra["reward_margin"] == pytest.approx(rb["reward_margin"], abs=1e-5), ra["step"]


@pytest.fixture(scope="module")
def tp1(corpus, lm_ref, tmp_path_factory):
    return launch_local(run_dpo, 1, dpo_config(corpus, tmp_path_factory.mktemp("tp1"),
                                               lm_ref))[0]


@pytest.mark.slow
def test_dpo_starts_at_ln2_and_learns_the_preference(tp1):
    train = _train(tp1)
    # Step 1: the policy is its reference (the same weights, the same forward), so every
    # pair's log-ratio difference is 0 and its loss is -log sigmoid(0).
    assert train[0]["loss"] == pytest.approx(math.log(2), rel=1e-6)
    assert train[0]["reward_margin"] == pytest.approx(0, abs=1e-6)
    evals = [r for r in tp1["history"] if r["split"] == "eval"]
    print([(r["step"], round(r["loss"], 4), round(r["reward_margin"], 4),
            r["reward_accuracy"]) for r in evals])
    assert evals[-1]["loss"] < evals[0]["loss"] < math.log(2)
    assert evals[-1]["reward_margin"] > 0 and evals[-1]["reward_accuracy"] > 0.8


@pytest.mark.slow
def test_tp2_pp2_equals_tp1_and_a_resume_equals_a_straight_run(corpus, lm_ref, tmp_path, tp1):
    layout = launch_local(run_dpo, 4, dpo_config(
        corpus, tmp_path / "tp2pp2", lm_ref, P(tensor_parallel=2, pipeline_parallel=2)))
    for out in layout:
        _assert_same(out["history"], tp1["history"])
    # Stopped after step 2 (a checkpoint), then continued to step 6: the reference the
    # resumed run builds is the starting checkpoint again.
    first = launch_local(run_dpo, 1, dpo_config(corpus, tmp_path / "split", lm_ref,
                                                steps=2))[0]
    assert first["checkpoint"].endswith("step_2")
    second = launch_local(run_dpo, 1, dpo_config(corpus, tmp_path / "split", lm_ref))[0]
    _assert_same(_train(first) + _train(second), _train(tp1), bitwise=True)


@pytest.mark.slow
def test_a_cached_reference_trains_as_the_live_one_without_its_weights(corpus, lm_ref,
                                                                        tmp_path, tp1):
    """Every pair scored once before step 1, over two DP ranks (each scores its share of
    every batch of the cache): the run equals the live reference's at TP1 (the cache scores
    pairs in other batches, so other padded widths: rounding, within REL), and the frozen
    reference's weights are dropped before training. The cache and the steps run in
    micro-batches of up to 128 tokens (1-3 pairs of rows up to 48 tokens, cut to their
    widths) instead of TP1's four pairs of the batch's width: the losses are means over the
    global batch's pairs, so the grouping changes only rounding too."""
    outs = launch_local(run_dpo, 2, dpo_config(corpus, tmp_path, lm_ref,
                                               settings=DPOSettings(reference="cached"),
                                               max_tokens_per_micro_batch=128))
    def comparable(history):  # step 1's margins are rounding (+-1e-8): their sign is noise
        return [{**r, "reward_accuracy": None} if r["step"] == 1 else r for r in history]

    for out in outs:
        _assert_same(comparable(out["history"]), comparable(tp1["history"]))
    # TP1: a micro-batch per pair. DP2: each rank holds about four pairs a step, several to
    # a micro-batch under the budget.
    assert {r["microbatches"] for r in _train(tp1)} == {8}
    counts = [r["microbatches"] for out in outs for r in _train(out)]
    assert max(counts) < 4, counts
    assert _train(outs[0])[0]["loss"] == pytest.approx(math.log(2), rel=1e-6)
    event, = [r for r in read_metrics(str(tmp_path)) if r.get("event") == "prepare"]
    # The reference is the whole model on each rank: the checkpoint's tensors, counted from
    # its own metadata.
    meta = dcp.FileSystemReader(lm_ref).read_metadata().state_dict_metadata
    weights = sum(m.size.numel() * torch.empty(0, dtype=m.properties.dtype).element_size()
                  for m in meta.values() if isinstance(m, dcp.metadata.TensorStorageMetadata))
    kept = outs[0]["data"]["train"]["kept"]  # training and held-out pairs
    assert (event["pairs"], event["reference_bytes_freed"]) == (kept, weights)


@pytest.mark.slow
def test_a_mixture_of_experts_policy_at_ep2_equals_ep1(corpus, tiny, tmp_path):
    """4 experts, top-2, with the load-balancing loss: at EP2 each rank holds two experts of
    the policy and of the frozen reference; the run equals one rank's."""
    moe = dataclasses.replace(tiny, num_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2,
                              moe_aux_loss_coeff=0.01)
    ckpt = str(tmp_path / "moe")
    launch_local(workers.write_reference, 1, ckpt, moe, 0)

    def run(name, nprocs, parallel):
        return launch_local(run_dpo, nprocs, dpo_config(corpus, tmp_path / name, ckpt, parallel,
                                                        steps=4, eval_interval=0))

    one = run("ep1", 1, P())[0]
    assert _train(one)[0]["loss"] == pytest.approx(math.log(2), rel=1e-6)
    assert _train(one)[-1]["loss"] < math.log(2) - 1e-3
    for out in run("ep2", 2, P(expert_parallel=2)):
        _assert_same(out["history"], one["history"])


@pytest.mark.slow
def test_kto_starts_at_one_half_learns_and_its_kl_estimate_spans_data_parallel_ranks(
        corpus, lm_ref, tmp_path):
    settings = DPOSettings(loss="kto")
    kto = dict(settings=settings, eval_fraction=0.25, steps=8, eval_interval=4)
    # Micro-batches of up to 64 tokens at DP2 (each rank its own count of them, the
    # mismatched rows cut to their own widths) against one rank's four rows per micro-batch.
    two = launch_local(run_dpo, 2, dpo_config(corpus, tmp_path / "dp2", lm_ref, **kto,
                                              max_tokens_per_micro_batch=64))
    train = _train(two[0])
    # Step 1: policy = reference, so every log-ratio and the KL estimate are 0 and each
    # row's loss is 1 - sigmoid(0).
    assert train[0]["loss"] == pytest.approx(0.5, rel=1e-6) and train[0]["kl"] == 0
    evals = [r for r in two[0]["history"] if r["split"] == "eval"]
    print([(r["step"], round(r["loss"], 4), round(r["kl"], 5), round(r["reward_margin"], 4))
           for r in two[0]["history"]])
    assert evals[-1]["loss"] < evals[0]["loss"] < 0.5 and evals[-1]["reward_margin"] > 0
    assert any(r["kl"] > 0 for r in train)
    # Two DP ranks each score half the mismatched rows, and the estimate is the global one:
    # one rank's first 4 steps (the learning rate is constant) give the same numbers.
    one = launch_local(run_dpo, 1, dpo_config(corpus, tmp_path / "dp1", lm_ref,
                                              **{**kto, "steps": 4}))[0]
    for out in two:
        for ra, rb in zip(out["history"], one["history"]):
            for k in ("loss", "kl", "grad_norm", "chosen_logp", "rejected_logp"):
                if k in rb:
                    assert ra[k] == pytest.approx(rb[k], rel=REL, abs=1e-9), (ra["step"], k)
    assert len(one["history"]) == 5  # steps 1-4 and the evaluation at step 4


@pytest.mark.slow
def test_with_lora_the_reference_is_the_base_with_adapters_off(corpus, lm_ref, tmp_path):
    out = launch_local(run_dpo, 1, dpo_config(corpus, tmp_path, lm_ref, lora=LoraConfig(
        rank=8, alpha=16), steps=4, eval_interval=0))[0]
    train = _train(out)
    # Adapters start at B = 0: the policy is its base, the loss ln 2. Afterwards the
    # reference must stay the base: had it followed the adapters, every margin would be 0.
    assert train[0]["loss"] == pytest.approx(math.log(2), rel=1e-6)
    assert train[-1]["loss"] < math.log(2) - 1e-3 and train[-1]["reward_margin"] > 0


@pytest.mark.slow
def test_packed_pairs_at_cp2_equal_one_sequence_per_row_at_tp1(corpus, lm_ref, tmp_path):
    """Pairs of one packed length L, two to a row of 2 x max_length = 2L: the stream shuffles
    pairs, then packs them in order, so each step of 4 packed rows holds the same 8 pairs as
    an unpacked run's step, and the runs agree as layouts do. The packed run is also split
    over two context-parallel ranks (each holds half of every row; the sequences' logprobs
    are whole again before the loss)."""
    from megarlhf.data.dataset import load_examples
    from megarlhf.data.pairs import pair_length
    from megarlhf.data.tokenizer import load_tokenizer

    records = synthetic.preference_records(400, seed=1)
    every = synthetic.write_jsonl(records, str(tmp_path / "all.jsonl"))
    examples = load_examples(DataConfig(train=DatasetSource(path=every),
                                        tokenizer=corpus["sp"], max_length=64),
                             "pairwise", load_tokenizer(corpus["sp"])).train
    lengths = [pair_length(ex) for ex in examples]
    L = max(set(lengths), key=lengths.count)
    same = [r for r, n in zip(records, lengths, strict=True) if n == L]
    assert len(same) >= 30, len(same)
    path = synthetic.write_jsonl(same, str(tmp_path / "same.jsonl"))

    def config(name: str, pack: bool, rows: int, per_micro_batch: int,
               parallel: P = P()) -> DPOConfig:
        return DPOConfig(
            model=ModelSource(checkpoint=lm_ref, layer_spec="local"),
            data=DataConfig(train=DatasetSource(path=path), tokenizer=corpus["sp"],
                            max_length=L, eval_fraction=0.1),
            train=LoopConfig(output_dir=str(tmp_path / name), steps=3, global_batch_size=rows,
                             micro_batch_size=per_micro_batch, eval_interval=3),
            parallel=parallel, optim=OPTIM, pack=pack)

    unpacked = launch_local(run_dpo, 1, config("unpacked", False, 8, 2))[0]
    for packed in launch_local(run_dpo, 2, config("packed", True, 4, 1,
                                                  P(context_parallel=2))):
        assert [r["pairs"] for r in _train(packed)] == [8, 8, 8]
        _assert_same(packed["history"], unpacked["history"])


@pytest.mark.slow
def test_ipo_starts_at_its_target_gap(corpus, lm_ref, tmp_path):
    settings = DPOSettings(loss="ipo", beta=0.2)
    out = launch_local(run_dpo, 1, dpo_config(corpus, tmp_path, lm_ref, settings=settings,
                                              steps=1, eval_interval=0))[0]
    assert _train(out)[0]["loss"] == pytest.approx(1 / (4 * 0.2 ** 2), rel=1e-6)


@pytest.mark.slow
def test_cli_simpo_on_two_ranks_exports_hf(corpus, lm_ref, tmp_path):
    recipe = to_dict(dpo_config(corpus, tmp_path / "run", lm_ref,
                                settings=DPOSettings(loss="simpo"), steps=2))
    recipe["train"]["export_hf"] = str(tmp_path / "hf")
    path = tmp_path / "simpo.yaml"
    path.write_text(yaml.safe_dump(recipe))
    done = subprocess.run([sys.executable, "-m", "megarlhf.cli", "dpo", "--config", str(path),
                           "--nproc", "2"], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    steps = [r for r in read_metrics(str(tmp_path / "run")) if r.get("split") == "train"]
    assert [r["step"] for r in steps] == [1, 2]
    # SimPO has no reference: its first loss is -log sigmoid(beta h - gamma) of the starting
    # model's own length-normalised margins, not a constant; finite and logged per pair.
    assert all(math.isfinite(r["loss"]) and r["pairs"] == 8 for r in steps), steps
    assert os.path.isfile(tmp_path / "hf" / "config.json")
