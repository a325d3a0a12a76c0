"""SFT and reward-model training: configs and their errors, the pairwise loss, and (slow)
whole runs across layouts, packing, resume, learning, and the command line with HF export.

Tolerances: layouts and packing change only fp32 summation order (TP-split matmuls, other
micro-batch shapes, RoPE angles at other absolute positions), ~1e-7 relative per forward.
Over 3 Adam steps (eps 1e-6, so no update is rounding noise blown up) losses and gradient
norms stay within 1e-5 relative (measured: SFT TP2xPP2 3e-8 / 2e-7, packed vs unpacked 9e-8 /
0), reward scores, which sit near 0, within 1e-5 absolute; a real fault (a micro-batch or DP
rank counted twice, a mask leaking across packed documents, a pair split between
micro-batches) moves them by 1e-3 or more.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
import yaml

from megarlhf.data import synthetic
from megarlhf.data.config import DataConfig, DatasetSource
from megarlhf.data.tokenizer import train_sentencepiece
from megarlhf.engine.optim import OptimConfig
from megarlhf.models.lora import LoraConfig
from megarlhf.parallel import launch_local
from megarlhf.parallel.mesh import ParallelConfig as P
from megarlhf.sft.config import LoopConfig, ModelSource, RMConfig, SFTConfig
from megarlhf.configio import apply_overrides, from_dict, load_config, to_dict
from megarlhf.metrics import read_metrics
from megarlhf.sft.loop import plan, run_checkpoints
from megarlhf.sft.rm import pairwise_loss, rm_metrics, rm_stage, run_rm
from megarlhf.sft.sft import run_sft, sft_stage
from tests import sft_workers
from tests.grouping import grouped_launches, selected_ids
from tests.test_ppo_metrics import tensorboard_scalars

REL = 1e-5
OPTIM = OptimConfig(lr=1e-3, weight_decay=0.01, clip_grad=1.0, adam_eps=1e-6)
MAX_LENGTH = 48


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A SentencePiece model trained on the demo text and the demo's data as JSONL files."""
    root = tmp_path_factory.mktemp("corpus")
    return {
        "sp": train_sentencepiece(synthetic.tokenizer_corpus(), str(root / "sp.model"),
                                  vocab_size=256),
        "sft": synthetic.write_jsonl(synthetic.sft_records(200), str(root / "sft.jsonl")),
        "pairs": synthetic.write_jsonl(synthetic.preference_records(400, seed=1),
                                       str(root / "pairs.jsonl")),
        "heldout": synthetic.write_jsonl(synthetic.preference_records(200, seed=11),
                                         str(root / "heldout.jsonl")),
    }


def _data(corpus, key, **kw) -> DataConfig:
    return DataConfig(train=DatasetSource(path=corpus[key]), tokenizer=corpus["sp"],
                      max_length=MAX_LENGTH, **kw)


def sft_config(corpus, out, ckpt, parallel=P(), **train) -> SFTConfig:
    return SFTConfig(
        model=ModelSource(checkpoint=ckpt, layer_spec="local") if ckpt
        else ModelSource(preset="tiny", layer_spec="local"),
        data=_data(corpus, "sft", eval_fraction=0.05),
        train=LoopConfig(output_dir=str(out), **{"steps": 3, "global_batch_size": 4, **train}),
        parallel=parallel, optim=OPTIM)


def rm_config(corpus, out, model: ModelSource, parallel=P(), *, optim=OPTIM, heldout=False,
              **train) -> RMConfig:
    """Eval on the separately generated held-out pairs, or on 5% of the training pairs."""
    held = {"eval": DatasetSource(path=corpus["heldout"])} if heldout \
        else {"eval_fraction": 0.05}
    return RMConfig(
        model=model,
        data=_data(corpus, "pairs", **held),
        train=LoopConfig(output_dir=str(out), **{"steps": 3, "global_batch_size": 4, **train}),
        parallel=parallel, optim=optim, margin=0.1)


# -- configs (fast) --

MINIMAL = {"model": {"preset": "tiny"}, "data": {"train": {"path": "x.jsonl"}},
           "train": {"output_dir": "out", "steps": 2, "global_batch_size": 4}}


def test_yaml_config_maps_onto_the_dataclasses(tmp_path):
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump({
        **MINIMAL, "optim": {"lr": "1e-3"}, "parallel": {"tensor_parallel": 2},
        "model": {"preset": "tiny", "overrides": {"vocab_size": 256}}}))
    cfg = load_config(SFTConfig, str(path), ["train.steps=7", "data.train.fields.prompt=q",
                                             "data.eval_fraction=0.1"])
    assert cfg.train.steps == 7 and cfg.optim.lr == 1e-3  # '1e-3' is a string in YAML 1.1
    assert cfg.parallel.tensor_parallel == 2 and cfg.data.train.fields == {"prompt": "q"}
    assert cfg.model.preset_config().vocab_size == 256
    assert from_dict(SFTConfig, to_dict(cfg)) == cfg


def minimal_recipe() -> dict:
    """A 'module:function' recipe: the same loader reads it as it reads YAML."""
    return MINIMAL


def test_every_recipe_form_reads_through_one_loader(tmp_path):
    from megarlhf.ppo.config import PPOConfig

    cfg = load_config(SFTConfig, "tests.test_sft_rm:minimal_recipe", ["train.steps=5"])
    assert cfg.train.steps == 5 and cfg.data.train.path == "x.jsonl"
    assert load_config(SFTConfig, "tests.test_sft_rm:minimal_recipe") == \
        from_dict(SFTConfig, MINIMAL)
    with pytest.raises(ValueError, match=r"returned list, not a SFTConfig or a mapping"):
        load_config(SFTConfig, "tests.test_sft_rm:_listed")
    with pytest.raises(ValueError, match="neither an existing YAML file nor module:function"):
        load_config(SFTConfig, str(tmp_path / "missing.yaml"))
    # The same messages for every command's config.
    empty = tmp_path / "empty.yaml"
    empty.write_text("{}\n")
    for cls in (SFTConfig, PPOConfig):
        with pytest.raises(ValueError, match=rf"unknown key\(s\) \['stpes'\] in {empty}; "
                                             rf"valid keys"):
            load_config(cls, str(empty), ["stpes=3"])


def _listed():
    return [MINIMAL]


@pytest.mark.parametrize("overrides,match", [
    (["trian.steps=3"], r"unknown key\(s\) \['trian'\] in config; valid keys"),
    (["data.train.pathh=y"], r"unknown key\(s\) \['pathh'\] in config.data.train"),
    (["train.steps=ten"], "config.train.steps must be int, got 'ten'"),
    (["train.steps=0"], "train.steps must be >= 1"),
    (["train.micro_batch_size=3"], "must be a multiple of train.micro_batch_size"),
    (["train.micro_batch_size=2", "train.max_tokens_per_micro_batch=64"],
     "give it or train.micro_batch_size, not both"),
    (["train.max_tokens_per_micro_batch=0"], "train.max_tokens_per_micro_batch must be >= 1"),
    (["train.keep_last=0"], "train.keep_last must be >= 1"),
    (["model.checkpoint=ck"], "exactly one of preset or checkpoint"),
    (["model.preset=huge"], "unknown model preset 'huge'"),
    (["model.overrides.vocab=3"], r"unknown ModelConfig fields \['vocab'\]"),
    (["model.dtype=fp8"], "unknown dtype 'fp8'"),
    (["data.template=chatml"], "unknown template 'chatml'"),
    (["data.on_bad_record=ignore"], "on_bad_record must be one of"),
    (["data.train.fields.margin=m"], r"fields \['margin'\] are not fields of sft records"),
    (["train.eval_interval=5"], "no eval data"),
    (["parallel.sequence_parallel=true"], "sequence_parallel=True needs tensor_parallel > 1"),
    (["data.eval_fraction=1.5"], r"eval_fraction must be in \[0, 1\)"),
    (["train.steps"], "is not key=value"),
    (["train.steps.x=1"], "steps is not a mapping"),
    (["train.profile_steps=[4]"], r"train.profile_steps is set but train.profile=false"),
    (["train.profile=true", "train.profile_steps=[0, 1]"],
     r"train.profile_steps \[0\] are not steps of this run \(1..2\)"),
])
def test_config_errors_say_what_is_wrong(overrides, match):
    with pytest.raises(ValueError, match=match):
        from_dict(SFTConfig, apply_overrides(MINIMAL, overrides))


def test_config_missing_keys_and_runtime_batch_check():
    with pytest.raises(ValueError, match=r"missing required key\(s\) \['train'\]"):
        from_dict(SFTConfig, {k: v for k, v in MINIMAL.items() if k != "train"})
    loop = LoopConfig(output_dir="o", steps=1, global_batch_size=8, micro_batch_size=2)
    assert loop.num_microbatches(dp_size=2) == 2
    with pytest.raises(ValueError, match="data-parallel size x micro_batch_size = 3 x 2"):
        loop.num_microbatches(dp_size=3)
    with pytest.raises(ValueError, match="overrides apply to presets only"):
        ModelSource(checkpoint="ck", overrides={"vocab_size": 3})


def test_cli_reports_config_and_data_errors_without_a_traceback(corpus, tmp_path, capsys):
    from megarlhf.cli import main

    path = tmp_path / "rm.yaml"
    path.write_text(yaml.safe_dump({**MINIMAL, "margin": "wide"}))
    with pytest.raises(SystemExit) as exit_info:
        main(["rm", "--config", str(path)])
    assert exit_info.value.code == 2
    assert "rm.yaml.margin must be float, got 'wide'" in capsys.readouterr().err
    # Data problems are found before any rank is spawned.
    path.write_text(yaml.safe_dump({**MINIMAL, "data": {"train": {"path": "none.jsonl"},
                                                        "tokenizer": corpus["sp"],
                                                        "max_length": 64}}))
    with pytest.raises(SystemExit):
        main(["rm", "--config", str(path), "--nproc", "2"])
    assert "error: dataset none.jsonl does not exist" in capsys.readouterr().err


def _fake_checkpoint(path, **meta):
    from megarlhf.engine.checkpoint import COMPLETE_MARKER

    os.makedirs(path)
    with open(os.path.join(path, COMPLETE_MARKER), "w") as f:
        json.dump(meta, f)
    return str(path)


def _plan(cfg):
    return plan(cfg, functools.partial(rm_stage if isinstance(cfg, RMConfig) else sft_stage,
                                       cfg))


def test_runs_refuse_bad_setups_before_any_process_group(corpus, tmp_path, tiny):
    ok = sft_config(corpus, tmp_path / "run", None)
    assert len(_plan(ok).examples.train) == 190 and _plan(ok).resume_from is None
    cases = [
        (dataclasses.replace(ok, model=ModelSource(preset="tiny",
                                                   overrides={"vocab_size": 100})),
         "has 256 tokens, more than the model's vocab_size=100"),
        (dataclasses.replace(ok, data=dataclasses.replace(ok.data, max_length=512)),
         "max_length=512 exceeds the model's max_position_embeddings=256"),
        (dataclasses.replace(ok, data=dataclasses.replace(ok.data, tokenizer=None)),
         "data.tokenizer is not set"),
        # A pair's two rows of up to 48 tokens, padded to CP2's multiple of 4: 96.
        (rm_config(corpus, tmp_path / "rm", ModelSource(preset="tiny"),
                   P(context_parallel=2), max_tokens_per_micro_batch=95),
         r"train.max_tokens_per_micro_batch=95 cannot hold a pair's two rows of up to 48 "
         r"tokens \(96 padded to a multiple of 4\); raise it to at least 96"),
        (dataclasses.replace(ok, parallel=P(pipeline_parallel=2, virtual_pipeline_parallel=2),
                             train=dataclasses.replace(ok.train,
                                                       max_tokens_per_micro_batch=64)),
         "max_tokens_per_micro_batch with parallel.virtual_pipeline_parallel"),
        (dataclasses.replace(ok, model=ModelSource(preset="tiny", overrides={
            "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 32}),
            parallel=P(expert_parallel=2),
            train=dataclasses.replace(ok.train, max_tokens_per_micro_batch=64)),
         "max_tokens_per_micro_batch with expert groups that span data-parallel ranks"),
    ]
    value_ckpt = _fake_checkpoint(tmp_path / "value", value_head=True, model=tiny.to_dict())
    cases.append((dataclasses.replace(ok, model=ModelSource(checkpoint=value_ckpt)),
                  "holds a value model"))
    lora_ckpt = _fake_checkpoint(tmp_path / "lora", value_head=False, model=tiny.to_dict(),
                                 lora={"rank": 4})
    cases.append((dataclasses.replace(ok, model=ModelSource(checkpoint=lora_ckpt)),
                  "holds LoRA adapters; a stage starts from full weights: export it merged"))
    for cfg, match in cases:
        with pytest.raises(ValueError, match=match):
            _plan(cfg)
    _fake_checkpoint(tmp_path / "run" / "checkpoints" / "step_0000002",
                     extra={"stage": "sft", "train_examples": 99, "data_seed": 0})
    with pytest.raises(ValueError, match="set train.resume=true"):
        _plan(dataclasses.replace(ok, train=dataclasses.replace(ok.train, resume=False)))
    with pytest.raises(ValueError, match=r"cannot resume .*'train_examples': \(99, 190\)"):
        _plan(ok)
    # The same data, but the checkpoint trained adapters the recipe no longer has.
    _fake_checkpoint(tmp_path / "run" / "checkpoints" / "step_0000004",
                     extra={"stage": "sft", "train_examples": 190, "data_seed": 0},
                     lora=LoraConfig(rank=4).to_dict())
    with pytest.raises(ValueError, match=r"it trained LoRA adapters \{'rank': 4.*model.lora "
                                         r"now gives none"):
        _plan(ok)


def test_pairwise_loss_and_metrics_match_the_formula():
    g = torch.Generator().manual_seed(0)
    values = torch.randn(6, 5, generator=g)
    last = torch.tensor([4, 2, 3, 3, 1, 4])
    margin = torch.tensor([0.5, 0.5, 0.0, 0.0, 1.0, 1.0])
    weight = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0])  # the third pair is filler
    loss, pairs, sums = pairwise_loss(
        {"last_index": last, "margin": margin, "pair_weight": weight}, values)
    s = values[torch.arange(6), last]
    expected = [-torch.nn.functional.logsigmoid(s[0] - s[1] - 0.5),
                -torch.nn.functional.logsigmoid(s[2] - s[3])]
    assert int(pairs) == 2
    assert float(loss) == pytest.approx(float(sum(expected)), rel=1e-6)
    m = rm_metrics({k: float(v) for k, v in sums.items()})
    assert m["accuracy"] == ((s[0] > s[1]).float() + (s[2] > s[3]).float()).item() / 2
    assert m["chosen_score"] == pytest.approx(float(s[0] + s[2]) / 2, rel=1e-6)


def test_checkpoints_are_found_by_step_in_either_name_format_and_only_complete_ones_pruned(
        tmp_path):
    """step_N, and step_000000N as earlier versions wrote; interrupted saves lack the marker."""
    from megarlhf.engine.checkpoint import COMPLETE_MARKER

    saved = run_checkpoints(str(tmp_path))
    assert saved.latest() is None
    for name, complete in (("step_0000002", True), ("step_9", True), ("step_0000010", True),
                           ("step_12", False), ("step_12.tmp", True), ("mine", True)):
        os.makedirs(tmp_path / "checkpoints" / name)
        if complete:
            (tmp_path / "checkpoints" / name / COMPLETE_MARKER).write_text("{}")
    assert saved.latest() == str(tmp_path / "checkpoints" / "step_0000010")  # 10 > 9
    assert saved.path(11) == str(tmp_path / "checkpoints" / "step_11")
    saved.prune(keep_last=2)
    assert sorted(os.listdir(saved.root)) == [
        "mine", "step_0000010", "step_12", "step_12.tmp", "step_9"]


# -- whole runs (slow) --

def _train(history):
    return [r for r in history if r["split"] == "train"]


def _assert_same_run(a: dict, b: dict, budget: int | None = None):
    """With a token budget `a` must also have run fewer micro-batches than `b`'s one row
    (pair) each at some step: the budget took effect."""
    if budget:
        fewer = [ra["microbatches"] < rb["microbatches"]
                 for ra, rb in zip(_train(a["history"]), _train(b["history"]))]
        assert any(fewer), fewer
    assert len(a["history"]) == len(b["history"])
    for ra, rb in zip(a["history"], b["history"]):
        assert (ra["step"], ra["split"]) == (rb["step"], rb["split"])
        for k in ("loss", "grad_norm", "lr", "tokens", "pairs", "accuracy"):
            if k in rb:
                assert ra[k] == pytest.approx(rb[k], rel=REL, abs=1e-9), f"{ra['step']} {k}"
        for k in ("chosen_score", "rejected_score"):  # near 0: absolute, as values in test_roles
            if k in rb:
                assert ra[k] == pytest.approx(rb[k], rel=0, abs=1e-5), f"{ra['step']} {k}"


@pytest.fixture(scope="module")
def sft_tp1(corpus, lm_ref, tmp_path_factory):
    ref = launch_local(run_sft, 1, sft_config(corpus, tmp_path_factory.mktemp("tp1"), lm_ref,
                                              micro_batch_size=1))[0]
    losses = [r["loss"] for r in _train(ref["history"])]
    assert losses[-1] < losses[0]  # the run learns, so equal curves mean equal updates
    assert ref["history"][-1]["split"] == "eval" and ref["history"][-1]["tokens"] > 0
    return ref


SFT_LAYOUTS = {"TP2xPP2": P(tensor_parallel=2, pipeline_parallel=2),
               # rows padded to a multiple of 4, split over 2 ranks
               "CP2xPP2": P(context_parallel=2, pipeline_parallel=2)}
RM_LAYOUTS = {"TP2xPP2": P(tensor_parallel=2, pipeline_parallel=2),
              "TP2xCP2": P(tensor_parallel=2, context_parallel=2)}
# Micro-batches by token budget instead of one row (pair) each, in one layout per stage: SFT's
# packed rows of up to 48 tokens two to a micro-batch of 96, RM's pairs one to three to 128;
# varying shapes through the pipeline stages.
BUDGETS = {"sft-CP2xPP2": 96, "rm-TP2xPP2": 128}


@pytest.fixture(scope="module")
def layout_runs(request, corpus, lm_ref, value_refs, tmp_path_factory):
    """Each 4-rank SFT and RM run of the layout tests; the selected ones in one launch."""
    root = tmp_path_factory.mktemp("layouts")
    model = ModelSource(checkpoint=value_refs[False][1], layer_spec="local")
    def budget(name):
        return {"max_tokens_per_micro_batch": BUDGETS.get(name)}

    cases = {f"sft-{name}": (4, run_sft, (sft_config(corpus, root / f"sft-{name}", lm_ref,
                                                      parallel, micro_batch_size=1,
                                                      **budget(f"sft-{name}")),), {})
             for name, parallel in SFT_LAYOUTS.items()}
    cases |= {f"rm-{name}": (4, run_rm, (rm_config(corpus, root / f"rm-{name}", model, parallel,
                                                   optim=RM_OPTIM, micro_batch_size=1,
                                                   **budget(f"rm-{name}")),), {})
              for name, parallel in RM_LAYOUTS.items()}
    wanted = ({f"sft-{i}" for i in selected_ids(request, "test_sft_layout_equals_tp1")}
              | {f"rm-{i}" for i in selected_ids(request, "test_rm_layout_equals_tp1")})
    return grouped_launches(cases, wanted)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(SFT_LAYOUTS))
def test_sft_layout_equals_tp1(layout, layout_runs, sft_tp1):
    for out in layout_runs(f"sft-{layout}"):  # every rank reports the same metrics
        _assert_same_run(out, sft_tp1, BUDGETS.get(f"sft-{layout}"))


@pytest.mark.slow
def test_packed_and_unpacked_documents_give_the_same_loss(corpus, lm_ref):
    out = launch_local(sft_workers.packed_vs_unpacked, 1, lm_ref, corpus["sp"], corpus["sft"],
                       documents=12, max_length=MAX_LENGTH, optim=OPTIM)[0]
    packed, unpacked = out["packed"], out["unpacked"]
    assert packed["rows"] < unpacked["rows"] == 12  # really packed
    assert packed["tokens"] == unpacked["tokens"]  # response tokens only, same in both
    for key in ("loss", "grad_norm", "loss_after"):
        assert packed[key] == pytest.approx(unpacked[key], rel=REL), key
    assert packed["loss_after"] < packed["loss"] - 1e-3


# lr 3e-4: at 1e-3 a fresh head's first steps are so sharp (grad norm x5 per step) that they
# amplify rounding to 3e-6 by step 3, which says nothing about the layout; at 3e-4 everything
# stays within 3e-7 (measured).
RM_OPTIM = dataclasses.replace(OPTIM, lr=3e-4)


@pytest.fixture(scope="module")
def rm_tp1(corpus, value_refs, tmp_path_factory):
    model = ModelSource(checkpoint=value_refs[False][1], layer_spec="local")
    ref = launch_local(run_rm, 1, rm_config(corpus, tmp_path_factory.mktemp("rm_tp1"), model,
                                            optim=RM_OPTIM))[0]
    assert ref["history"][-1] == {**ref["history"][-1], "split": "eval", "pairs": 20}
    return ref


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(RM_LAYOUTS))
def test_rm_layout_equals_tp1(layout, layout_runs, rm_tp1):
    """Under CP the score is read at each row's last real token of the gathered rows."""
    for out in layout_runs(f"rm-{layout}"):
        _assert_same_run(out, rm_tp1, BUDGETS.get(f"rm-{layout}"))


@pytest.mark.slow
def test_rm_ranks_held_out_pairs_well_above_chance(corpus, tmp_path):
    model = ModelSource(preset="tiny", overrides={"vocab_size": 256}, layer_spec="local")
    cfg = rm_config(corpus, tmp_path / "rm", model, steps=20, global_batch_size=16,
                    eval_interval=10, heldout=True)
    out = launch_local(run_rm, 1, cfg)[0]
    evals = [r for r in out["history"] if r["split"] == "eval"]
    first = _train(out["history"])[0]
    assert 0.2 < first["accuracy"] < 0.8  # untrained: near chance
    assert evals[-1]["pairs"] == 200 and evals[-1]["accuracy"] > 0.8, evals


@pytest.mark.slow
def test_lora_dropout_masks_do_not_depend_on_the_layout(corpus, lm_ref, tmp_path):
    """LoRA dropout 0.2: TP2+SP x PP2 trains TP1's curve (1e-5 relative: each element's mask
    is a hash of its global index and a seed of step, layer and call), and the masks matter:
    the step-1 gradient norm (B's; A's is 0 while B is) moves off the run without dropout."""
    from tests import workers

    def config(out, parallel, dropout):
        cfg = sft_config(corpus, out, lm_ref, parallel, micro_batch_size=1, steps=2)
        return dataclasses.replace(cfg, model=dataclasses.replace(
            cfg.model, lora=LoraConfig(rank=4, dropout=dropout)),
            optim=dataclasses.replace(OPTIM, lr=1e-2))

    tp1, plain = launch_local(workers.in_sequence, 1, [
        (run_sft, (config(tmp_path / "tp1", P(), 0.2),), {}),
        (run_sft, (config(tmp_path / "plain", P(), 0.0),), {})])[0]
    for out in launch_local(run_sft, 4, config(tmp_path / "tp2pp2", P(
            tensor_parallel=2, pipeline_parallel=2, sequence_parallel=True), 0.2)):
        _assert_same_run(out, tp1)
    first, without = _train(tp1["history"])[0], _train(plain["history"])[0]
    assert first["loss"] == without["loss"]  # B = 0: dropout before A changes no output yet
    assert abs(first["grad_norm"] / without["grad_norm"] - 1) > 1e-2


@pytest.mark.slow
def test_lora_rm_from_an_lm_trains_its_adapters_and_value_head_only(corpus, lm_ref, tmp_path):
    """A reward model with LoRA (rank-stabilised scale) grown from an LM checkpoint: the
    trunk comes from the LM
    (adapters at their start), and after two steps only the adapters and the new value head
    differ from it."""
    from megarlhf.convert.mcore_io import CheckpointReader

    model = ModelSource(checkpoint=lm_ref, layer_spec="local",
                        lora=LoraConfig(rank=2, target_modules=["q_proj", "v_proj"],
                                        use_rslora=True))
    out = launch_local(run_rm, 1, rm_config(corpus, tmp_path / "rm", model, steps=2))[0]
    base, trained = CheckpointReader(lm_ref), CheckpointReader(out["checkpoint"])
    changed = set()
    for key, md in trained.metadata.state_dict_metadata.items():
        shape = trained.shape(key)
        if shape is None or not key.startswith(("decoder.", "embedding.", "value_head.")):
            continue
        whole = [(key, (0,) * len(shape), shape)]
        if base.shape(key) is None or not torch.equal(trained.read(whole)[0],
                                                      base.read(whole)[0]):
            changed.add(key)
    prefix = "decoder.layers.self_attention.linear_qkv.lora_"
    assert changed == {f"{prefix}{f}.{p}" for f in "AB" for p in ("q_proj", "v_proj")} | {
        k for k in trained.metadata.state_dict_metadata if k.startswith("value_head.")}


@pytest.mark.slow
def test_resume_continues_the_same_run_at_another_layout(corpus, lm_ref, tmp_path):
    straight = launch_local(run_sft, 1, sft_config(corpus, tmp_path / "a", lm_ref, steps=4,
                                                   save_interval=2))[0]
    # First half at TP1 x PP1 x DP2 (optimizer state sharded), second half resumed at TP1.
    launch_local(run_sft, 2, sft_config(corpus, tmp_path / "b", lm_ref, steps=2,
                                        save_interval=2))
    resumed = launch_local(run_sft, 1, sft_config(corpus, tmp_path / "b", lm_ref, steps=4,
                                                  save_interval=2))[0]
    assert [r["step"] for r in _train(resumed["history"])] == [3, 4]
    _assert_same_run(resumed, {"history": straight["history"][2:]})


@pytest.mark.slow
def test_sft_keeps_the_last_checkpoints_and_resumes_from_the_latest(corpus, lm_ref, tmp_path):
    """keep_last=2 of the saves at steps 2, 4 and 5. Then, as if the run had been killed during
    step 5's save (step_5 left as an unmarked .tmp), a rerun resumes from step 4: step 5 is
    trained as before, logged once, and the dashboards show the rerun's curve."""
    from megarlhf.engine.checkpoint import COMPLETE_MARKER

    out = tmp_path / "run"
    first = launch_local(run_sft, 1, sft_config(corpus, out, lm_ref, steps=5, save_interval=2,
                                                keep_last=2, tensorboard=True))[0]
    saved = run_checkpoints(str(out))
    assert sorted(os.listdir(saved.root)) == ["step_4", "step_5"]
    assert first["checkpoint"] == saved.latest() == saved.path(5)
    os.rename(saved.path(5), saved.path(5) + ".tmp")
    os.remove(os.path.join(saved.path(5) + ".tmp", COMPLETE_MARKER))

    rerun = launch_local(run_sft, 1, sft_config(corpus, out, lm_ref, steps=6, save_interval=2,
                                                keep_last=2, tensorboard=True))[0]
    assert [r["step"] for r in _train(rerun["history"])] == [5, 6]
    _assert_same_run({"history": rerun["history"][:1]}, {"history": _train(first["history"])[4:]})
    assert sorted(os.listdir(saved.root)) == ["step_4", "step_6"]  # the .tmp removed
    logged = [(r["step"], r["split"]) for r in read_metrics(str(out)) if "step" in r]
    assert logged == [(step, "train") for step in range(1, 7)] + [(6, "eval")]
    scalars = tensorboard_scalars(out / "tensorboard")
    assert [step for step, _ in scalars["train/loss"]] == [1, 2, 3, 4, 5, 6]
    assert scalars["train/loss"][4][1] == pytest.approx(rerun["history"][0]["loss"])
    assert scalars["eval/loss"] == [(6, pytest.approx(rerun["history"][-1]["loss"]))]


@pytest.mark.slow
def test_rm_writes_its_curves_to_tensorboard_and_profiles_a_step(corpus, value_refs, tmp_path):
    model = ModelSource(checkpoint=value_refs[False][1], layer_spec="local")
    out = launch_local(run_rm, 1, rm_config(corpus, tmp_path / "rm", model, steps=2,
                                            tensorboard=True, profile=True,
                                            profile_steps=(2,)))[0]
    scalars = tensorboard_scalars(tmp_path / "rm" / "tensorboard")
    for record in out["history"]:
        for key in ("loss", "accuracy", "chosen_score"):
            assert (record["step"], pytest.approx(record[key])) in \
                scalars[f"{record['split']}/{key}"]
    assert [step for step, _ in scalars["train/accuracy"]] == [1, 2]
    assert [step for step, _ in scalars["eval/accuracy"]] == [2]
    # Step 2's train step and evaluation, profiled: the train table inside the step's own
    # timing (step_s, which also holds the trace's export), with the model's matmuls and
    # the optimizer's update in it; a trace per phase.
    (event,) = [r for r in read_metrics(str(tmp_path / "rm")) if r.get("event") == "profile"]
    assert event["profiled_step"] == 2 and set(event["phases"]) == {"train", "eval"}, event
    train = event["phases"]["train"]
    assert 0 < train["wall_s"] <= out["history"][1]["step_s"], (train, out["history"])
    assert train["operators_s"] + train["host_s"] == pytest.approx(train["wall_s"])
    assert train["categories"]["matmul"] > 0 and train["categories"]["optimizer"] > 0, train
    assert sorted(os.listdir(tmp_path / "rm" / "profile" / "step_2")) == [
        "eval_1_rank0.json", "train_1_rank0.json"]


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "megarlhf.cli", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_cli_sft_then_rm_from_it_exports_a_working_hf_reward_model(corpus, tmp_path):
    """SFT on 2 ranks (DP2) with bad lines skipped and counted; the RM starts from the SFT
    checkpoint (trunk only, tokenizer carried in the checkpoint) at TP2; its HF export, with
    the tokenizer, ranks held-out pairs in transformers."""
    sft_data = tmp_path / "sft.jsonl"
    with open(sft_data, "wb") as f:
        f.write(open(corpus["sft"], "rb").read())
        f.write(b'{"prompt": "hi"}\n{"prompt": "", "response": "x"}\n\xff\xfe\n')
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump({
        "model": {"preset": "tiny", "overrides": {"vocab_size": 256}, "layer_spec": "local"},
        "data": {"train": {"path": str(sft_data)}, "tokenizer": corpus["sp"],
                 "max_length": MAX_LENGTH, "on_bad_record": "skip"},
        "train": {"output_dir": "sft", "steps": 4, "global_batch_size": 8,
                  "micro_batch_size": 2},
        "optim": {"lr": 1e-3}}))
    run = _cli("sft", "--config", "sft.yaml", "--nproc", "2", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    events = [json.loads(line) for line in open(tmp_path / "sft" / "metrics.jsonl")]
    data = events[0]["train"]
    assert data["skipped"] == 3 and data["reasons"] == {
        "empty prompt": 1, "invalid UTF-8": 1, "missing field 'response'": 1}
    assert "skipped 3 bad records" in run.stdout
    assert [e["step"] for e in events[1:]] == list(range(1, 5))
    sft_ckpt = run_checkpoints(str(tmp_path / "sft")).latest()

    (tmp_path / "rm.yaml").write_text(yaml.safe_dump({
        "model": {"checkpoint": sft_ckpt, "layer_spec": "local"},
        "data": {"train": {"path": corpus["pairs"]}, "max_length": MAX_LENGTH},
        "train": {"output_dir": "rm", "steps": 8, "global_batch_size": 16,
                  "export_hf": "rm_hf"}}))
    run = _cli("rm", "--config", "rm.yaml", "--nproc", "2", "parallel.tensor_parallel=2",
               "optim.lr=2e-3", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "new value head" in run.stdout and "exported" in run.stdout
    trained = [json.loads(line) for line in open(tmp_path / "rm" / "metrics.jsonl")][-1]
    assert trained["step"] == 8 and trained["accuracy"] > 0.8, trained

    import transformers

    from megarlhf.data.templates import PromptFormat
    from megarlhf.data.tokenizer import load_tokenizer

    hf = transformers.AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm_hf")
    fmt = PromptFormat(load_tokenizer(str(tmp_path / "rm_hf")), "auto")  # tokenizer exported
    correct = 0
    pairs = [json.loads(line) for line in open(corpus["heldout"])][:50]
    for rec in pairs:
        prompt = fmt.prompt(rec["prompt"])
        scores = [hf(torch.tensor([prompt + fmt.response(rec["prompt"], rec[k])])).logits.item()
                  for k in ("chosen", "rejected")]
        correct += scores[0] > scores[1]
    assert correct / len(pairs) > 0.8


@pytest.mark.slow
def test_lora_sft_at_other_layouts_equals_tp1_trains_only_adapters_and_exports_merged(
        corpus, lm_ref, tmp_path):
    """LoRA SFT (all seven projections, rank 4, gaussian A so the step-0 adapters are not
    kaiming's) at TP2+SP x PP2 and at CP2 has TP1's curve (losses, grad norms: 1e-5
    relative); a resume
    reproduces a step bit for bit; the final
    checkpoint holds the adapters and no base weight; the exported HF model (adapters
    merged) gives HF transformers' logits equal to our adapted model's, and so do PEFT over
    the base with the exported adapter and our model loading that adapter at TP2+SP (fp32,
    1e-5: same weights, other kernels and summation orders)."""
    import transformers

    from megarlhf.convert.mcore_io import CheckpointReader
    from megarlhf.models.lora import LoraConfig, is_adapter_key
    from tests import workers

    lora = LoraConfig(rank=4, alpha=8.0, init="gaussian", seed=3)

    def config(out, parallel, **train):
        cfg = sft_config(corpus, out, lm_ref, parallel, micro_batch_size=1, **train)
        return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lora=lora),
                                   optim=dataclasses.replace(OPTIM, lr=1e-2))

    exported = str(tmp_path / "hf")
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    ref, ours = launch_local(workers.in_sequence, 1, [
        (run_sft, (config(tmp_path / "tp1", P(), export_hf=exported, save_interval=1),), {}),
        (workers.forward_outputs, (str(tmp_path / "tp1" / "checkpoints" / "step_3"), P(),
                                   {"tokens": tokens}), {})])[0]
    assert ref["checkpoint"].endswith("step_3")
    losses = [r["loss"] for r in _train(ref["history"])]
    assert losses[-1] < losses[0]
    # Resumed from step 2 (adapters, their Adam states over the frozen base), step 3 is the same
    # bit for bit: every tensor of the checkpoint, optimizer included.
    shutil.copytree(tmp_path / "tp1", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "step_3")
    resumed = launch_local(run_sft, 1, config(tmp_path / "resumed", P()))[0]
    assert [r["step"] for r in _train(resumed["history"])] == [3]
    first, second = CheckpointReader(ref["checkpoint"]), CheckpointReader(resumed["checkpoint"])
    saved = {k for k in first.metadata.state_dict_metadata if first.shape(k) is not None}
    assert saved == {k for k in second.metadata.state_dict_metadata
                     if second.shape(k) is not None}
    assert any(k.startswith("optimizer.") and is_adapter_key(k) for k in saved), saved
    for key in saved:
        whole = [(key, (0,) * len(first.shape(key)), first.shape(key))]
        assert torch.equal(first.read(whole)[0], second.read(whole)[0]), key
    outs = launch_local(run_sft, 4, config(
        tmp_path / "tp2pp2", P(tensor_parallel=2, pipeline_parallel=2, sequence_parallel=True)))
    outs += launch_local(run_sft, 2, config(tmp_path / "cp2", P(context_parallel=2)))
    for out in outs:
        _assert_same_run(out, ref)

    base, trained = CheckpointReader(lm_ref), CheckpointReader(ref["checkpoint"])
    stored = [k for k in trained.metadata.state_dict_metadata if trained.shape(k) is not None]
    adapters = [k for k in stored if is_adapter_key(k) and k.startswith("decoder.")]
    assert len(adapters) == 2 * 7, adapters  # A and B of each projection, layers stacked
    weights = [k for k in base.metadata.state_dict_metadata if base.shape(k) is not None]
    assert weights and not [k for k in weights if trained.shape(k) is not None]
    assert all(not k.startswith("decoder.") or is_adapter_key(k) for k in stored), stored
    for key in adapters:  # A at its gaussian start, B moved off zero
        shape = trained.shape(key)
        assert trained.read([(key, (0,) * len(shape), shape)])[0].abs().max() > 0, key

    model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    with torch.no_grad():
        theirs = model(tokens).logits
    torch.testing.assert_close(ours[..., :theirs.shape[-1]], theirs, atol=1e-5, rtol=1e-5)
    # This checkpoint as a judge's model (reward_judge.model) streams the export's tensors,
    # the adapters merged, bit for bit.
    import glob

    from safetensors.torch import load_file

    from megarlhf.convert.mcore_to_hf import checkpoint_hf_tensors

    files = {}
    for path in glob.glob(os.path.join(exported, "*.safetensors")):
        files.update(load_file(path))
    streamed = dict(checkpoint_hf_tensors(ref["checkpoint"]))
    assert streamed.keys() == files.keys()
    assert all(torch.equal(streamed[k].to(files[k].dtype), files[k]) for k in files)

    # The adapters as a PEFT directory: PEFT over the exported base gives our logits, its
    # tensors are the checkpoint's bit for bit, and loaded back (lora.from_peft) at TP2+SP
    # they give our logits again.
    import peft

    from megarlhf.convert.mcore_to_hf import mcore_to_hf
    from megarlhf.models.peft_format import WEIGHTS_FILE, peft_module

    adapter = mcore_to_hf(ref["checkpoint"], str(tmp_path / "adapter"), lora="adapter")
    base_hf = mcore_to_hf(lm_ref, str(tmp_path / "base_hf"))
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(
            base_hf, dtype=torch.float32), adapter)(tokens).logits
    torch.testing.assert_close(ours[..., :theirs.shape[-1]], theirs, atol=1e-5, rtol=1e-5)
    written = load_file(os.path.join(adapter, WEIGHTS_FILE))
    assert len(written) == 2 * 7 * 4  # A and B of seven projections in four layers
    for key in adapters:
        shape = trained.shape(key)
        stacked = trained.read([(key, (0,) * len(shape), shape)])[0]
        factor, projection = key.rsplit(".", 2)[1:]
        for layer in range(shape[0]):
            name = f"base_model.model.{peft_module(layer, projection)}.{factor}.weight"
            assert torch.equal(written[name], stacked[layer]), name
    back = launch_local(sft_workers.peft_adapter_outputs, 2, lm_ref, adapter,
                        P(tensor_parallel=2, sequence_parallel=True), tokens)[0]
    torch.testing.assert_close(back, ours, atol=1e-5, rtol=1e-5)

    # A bf16 run started from the adapter trains from it: one step at lr 1e-7 leaves its B
    # within bf16 rounding (2^-8 relative) of the adapter's, not at a fresh zero.
    cfg = config(tmp_path / "bf16", P(), steps=1)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, dtype="bf16", lora=LoraConfig(from_peft=adapter)),
        optim=dataclasses.replace(OPTIM, lr=1e-7))
    step = CheckpointReader(launch_local(run_sft, 1, cfg)[0]["checkpoint"])
    key = "decoder.layers.mlp.linear_fc2.lora_B.down_proj"
    shape = step.shape(key)
    b = step.read([(key, (0,) * len(shape), shape)])[0].float()
    peft_b = torch.stack([written[f"base_model.model.{peft_module(i, 'down_proj')}"
                                  ".lora_B.weight"] for i in range(shape[0])])
    assert peft_b.abs().max() > 1e-3
    torch.testing.assert_close(b, peft_b.to(torch.bfloat16).float(), atol=1e-5, rtol=1e-2)
