"""The memory planner (`megarlhf plan`), the recipes it checks, and `--dry-run`.

- Parameter counts are exact integers: the planner's per-rank count must equal the model
  megatron-core builds for that rank, on the meta device (no memory), in a fake world of up to
  64 ranks (torch's "fake" process-group backend: each rank position is built in this process).
- Model-state bytes (weights, fp32 main grads, Adam states + master weights) are compared with
  the storages a real CPU TrainEngine holds after one step, within 10% (the issue's bound).
  Measured: the DDP buffer pads 186,944 tiny-model params to 187,008 (+0.03%) and Adam's
  per-parameter 'step' adds 4 bytes each (+0.007%); nothing else differs.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import subprocess
import re
import shlex
import time

import pytest
import torch
import torch.distributed as dist
import yaml

from megarlhf.cli import main as cli
from megarlhf.models.gpt import build_model, model_spec
from megarlhf.models.presets import preset
from megarlhf.parallel.mesh import Mesh, ParallelConfig
from megarlhf.plan import memory
from megarlhf.plan.params import rank_params, total_params
from tests.test_ppo import rollout_tp

RECIPES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes")


# -- parameter counts ----------------------------------------------------------------------

def test_presets_have_the_published_parameter_counts():
    # Totals from the models' cards / safetensors indexes; any wrong shape field changes them.
    assert total_params(preset("llama3-8b")) == 8_030_261_248
    assert total_params(preset("llama3-70b")) == 70_553_706_496
    assert total_params(preset("qwen2.5-72b")) == 72_706_203_648


@contextlib.contextmanager
def fake_rank(parallel: ParallelConfig, rank: int):
    """This process as global rank `rank` of a TP x PP world that does no communication."""
    from megatron.core import parallel_state as ps
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from megarlhf.compat.megatron import apply_cpu_compat

    apply_cpu_compat()
    world = parallel.model_parallel_size
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        # gloo side-groups cannot be made on the fake backend, and building needs none.
        ps.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tensor_parallel,
            pipeline_model_parallel_size=parallel.pipeline_parallel,
            virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_parallel,
            create_gloo_process_groups=False)
        yield Mesh(config=parallel, rank=rank, world_size=world, device=torch.device("cpu"),
                   backend="fake", tp_rank=ps.get_tensor_model_parallel_rank(),
                   pp_rank=ps.get_pipeline_model_parallel_rank(), dp_rank=0, dp_size=1,
                   tp_group=ps.get_tensor_model_parallel_group(),
                   pp_group=ps.get_pipeline_model_parallel_group(),
                   dp_group=ps.get_data_parallel_group(),
                   model_parallel_group=ps.get_model_parallel_group(), embedding_group=None)
    finally:
        ps.destroy_model_parallel()
        dist.destroy_process_group()


def built_params(model, parallel: ParallelConfig, tp_rank: int, pp_rank: int, *,
                 value_head: bool = False) -> int:
    """Parameters of the chunks megatron-core builds for (tp_rank, pp_rank), on meta."""
    spec = model_spec(model, parallel, value_head=value_head, layer_spec="local", on_gpu=False)
    # Megatron's default order is tp-cp-ep-dp-pp: with DP=1, rank = pp_rank * TP + tp_rank.
    with fake_rank(parallel, pp_rank * parallel.tensor_parallel + tp_rank) as mesh:
        assert (mesh.tp_rank, mesh.pp_rank) == (tp_rank, pp_rank)
        chunks = build_model(spec, mesh, meta=True)
        assert all(p.is_meta for c in chunks for p in c.parameters())
        return sum(p.numel() for c in chunks for p in c.parameters())


TP8 = dict(tensor_parallel=8)
CASES = [
    # (preset, layout, pipeline ranks: first, a middle one, last; value head)
    ("llama3-70b", ParallelConfig(pipeline_parallel=8, **TP8), (0, 3, 7), False),
    # the 70B recipes' actor layout
    ("llama3-70b", ParallelConfig(pipeline_parallel=4, **TP8), (0, 2, 3), False),
    # critic / reward: value head instead of the LM head
    ("llama3-70b", ParallelConfig(pipeline_parallel=4, **TP8), (0, 3), True),
    # interleaved: each rank holds 2 chunks, the embedding and head on different chunks
    ("llama3-70b", ParallelConfig(pipeline_parallel=4, virtual_pipeline_parallel=2, **TP8),
     (0, 3), False),
    # QKV bias
    ("qwen2.5-72b", ParallelConfig(pipeline_parallel=4, **TP8), (0, 3), False),
    # tied embeddings: at PP>1 the last stage holds its own copy of the output weight
    ("llama-1b", ParallelConfig(pipeline_parallel=2, **TP8), (0, 1), False),
    ("llama-1b", ParallelConfig(**TP8), (0,), False),
]


def case_id(case) -> str:
    name, p, _, value_head = case
    vpp = f"xVPP{p.virtual_pipeline_parallel}" if p.virtual_pipeline_parallel else ""
    return (f"{name}-TP{p.tensor_parallel}xPP{p.pipeline_parallel}{vpp}"
            f"{'-value' if value_head else ''}")


@pytest.mark.parametrize("name,parallel,pp_ranks,value_head", CASES,
                         ids=[case_id(c) for c in CASES])
def test_planned_rank_params_equal_the_meta_built_model(name, parallel, pp_ranks, value_head):
    model = preset(name)
    for pp_rank in pp_ranks:
        planned = rank_params(model, parallel, pp_rank, value_head=value_head)
        for tp_rank in (0, parallel.tensor_parallel - 1):
            assert built_params(model, parallel, tp_rank, pp_rank,
                                value_head=value_head) == planned, (pp_rank, tp_rank)


def test_planned_rank_params_with_qk_norm_equal_the_meta_built_model():
    # Qwen3's per-head q/k norms: replicated on every TP rank, like the layer norms.
    model = dataclasses.replace(preset("tiny"), qk_norm=True)
    parallel = ParallelConfig(tensor_parallel=2, pipeline_parallel=2)
    for pp_rank in (0, 1):
        for tp_rank in (0, 1):
            assert built_params(model, parallel, tp_rank, pp_rank) \
                == rank_params(model, parallel, pp_rank)


@pytest.mark.parametrize("pp,vpp", [(4, None), (4, 2), (8, 5)])
def test_in_flight_microbatches_follow_megatrons_schedules(pp, vpp):
    """Activations held = the chunk forwards a pipeline rank runs before its first backward
    (megatron-core's warm-up count) plus the one in 1F1B, each holding its chunk's layers."""
    from megatron.core.pipeline_parallel.schedules import get_pp_rank_microbatches

    model = preset("llama3-70b")
    parallel = ParallelConfig(tensor_parallel=1, pipeline_parallel=pp,
                              virtual_pipeline_parallel=vpp)
    chunks = parallel.num_chunks
    for pp_rank in (0, 1, pp - 1):
        with fake_rank(parallel, pp_rank):
            for microbatches in (1, 2, pp, 3 * pp):
                if vpp and microbatches % pp:
                    continue  # the interleaved schedule needs whole groups of PP micro-batches
                total, all_warmup, warmup, _ = get_pp_rank_microbatches(
                    microbatches, chunks, microbatch_group_size_per_vp_stage=pp)
                forwards = total if all_warmup else warmup + 1
                assert memory.in_flight_layers(model, parallel, pp_rank, microbatches) \
                    == forwards * model.num_layers // (pp * chunks), (pp_rank, microbatches)


# -- model-state bytes against a real run --------------------------------------------------

def storage_bytes(tensors) -> dict[int, int]:
    """{storage address: bytes} of the storages behind `tensors` (views counted once)."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}


def allocated_model_state(engine) -> dict[str, int]:
    """Bytes the engine holds: parameter storages, main-grad storages, and optimizer storages
    (states, master weights) that are neither of those."""
    params = [p for chunk in engine.chunks for p in chunk.parameters()]
    weights = storage_bytes(params)
    grads = storage_bytes(p.main_grad for p in params)
    inner = [o.optimizer for o in getattr(engine.optimizer, "chained_optimizers",
                                          [engine.optimizer])]
    state = [v for o in inner for s in o.state.values() for v in s.values()
             if torch.is_tensor(v)]
    state += [p for o in inner for group in o.param_groups for p in group["params"]]
    optimizer = {k: v for k, v in storage_bytes(state).items()
                 if k not in weights and k not in grads}
    return {"weights": sum(weights.values()), "grads": sum(grads.values()),
            "optimizer": sum(optimizer.values())}


def one_step_state(dtype: torch.dtype, parallel: ParallelConfig = ParallelConfig()):
    """(planned, allocated) model state of the tiny model after one training step."""
    from megarlhf.engine.losses import lm_loss
    from megarlhf.engine.optim import OptimConfig
    from megarlhf.engine.schedule import rank_microbatches
    from megarlhf.engine.train import TrainEngine
    from megarlhf.parallel.mesh import init_mesh
    from tests.workers import make_batch

    model = preset("tiny")
    mesh = init_mesh(parallel)
    spec = model_spec(model, parallel, dtype=dtype, layer_spec="local", on_gpu=False)
    engine = TrainEngine(spec, mesh, OptimConfig(use_distributed_optimizer=True))
    batch = make_batch(model, batch=2 * mesh.dp_size, seq=8, seed=0)
    engine.train_step(rank_microbatches(batch, mesh, 1), lm_loss(mesh, model.vocab_size))
    planned = memory.model_state(rank_params(model, parallel, mesh.pp_rank),
                                 dtype.itemsize, trained=True, dp=mesh.dp_size)
    return planned, allocated_model_state(engine)


def assert_within_10_percent(planned: dict, allocated: dict):
    assert planned.keys() == allocated.keys()
    for term in planned:
        assert abs(allocated[term] - planned[term]) <= 0.1 * allocated[term], \
            (term, planned[term], allocated[term])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_planned_model_state_matches_what_a_cpu_step_allocates(dtype):
    # bf16 differs from fp32 in every term: 2-byte weights, and 12 (not 8) optimizer bytes per
    # parameter for the fp32 master weights, a 50% difference the 10% bound would catch.
    from megarlhf.parallel.mesh import destroy_mesh

    try:
        planned, allocated = one_step_state(dtype)
    finally:
        destroy_mesh()
    assert_within_10_percent(planned, allocated)


def one_step_state_at(parallel: ParallelConfig):
    """One rank of the DP2 run (spawned)."""
    return one_step_state(torch.bfloat16, parallel)


@pytest.mark.slow
def test_planned_optimizer_shards_match_allocation_at_dp2():
    from megarlhf.parallel import launch_local

    results = launch_local(one_step_state_at, 2, ParallelConfig())
    for planned, allocated in results:
        assert_within_10_percent(planned, allocated)
        # Sharded: about half of the 12 bytes per parameter a DP1 run holds (fp32 grads are
        # 4 bytes per parameter, unsharded).
        assert allocated["optimizer"] < 0.6 * 12 * allocated["grads"] / 4


# -- the recipes ---------------------------------------------------------------------------

def recipe_plan_command(name: str) -> list[str]:
    """The `megarlhf plan ... preset:...` command a recipe's header gives, as CLI arguments."""
    with open(os.path.join(RECIPES, name)) as f:
        found = re.search(r"^#\s+megarlhf (plan .*preset:.*)$", f.read(), re.MULTILINE)
    assert found, f"{name} has no `megarlhf plan` command with presets in its header"
    args = shlex.split(found.group(1))
    return [os.path.join(RECIPES, name) if a == f"recipes/{name}" else a for a in args]


def run_cli(args: list[str], capsys) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_:
        cli(args)
    out = capsys.readouterr()
    return exit_.value.code, out.out, out.err


SMALL = ["llama3-8b-ppo.yaml", "llama3-8b-grpo.yaml"]
LARGE = ["llama3-70b-grpo.yaml", "llama3-70b-ppo.yaml", "qwen2.5-72b-ppo.yaml"]


CPU = ["smollm2-135m-grpo-arithmetic.yaml"]
"""Recipes that run on this machine: bench/bench_rlvr.py runs it end to end (its result is in
BENCHMARKS.md); here it must load, and its header's data command must make what it reads."""


def test_every_recipe_is_tested():
    assert sorted(os.listdir(RECIPES)) == sorted(SMALL + LARGE + CPU)


def test_the_cpu_recipe_loads_and_its_data_command_makes_its_prompts(tmp_path, monkeypatch):
    from megarlhf.configio import load_config
    from megarlhf.ppo.config import PPOConfig

    name = CPU[0]
    with open(os.path.join(RECIPES, name)) as f:
        (command,) = re.findall(r'^#\s+(python -c ".*")$', f.read(), re.MULTILINE)
    monkeypatch.chdir(tmp_path)
    os.makedirs("data/arithmetic")
    subprocess.run([sys.executable, "-c", shlex.split(command)[2]], check=True,
                   env={**os.environ, "PYTHONPATH": os.path.dirname(RECIPES)})
    config = load_config(PPOConfig, os.path.join(RECIPES, name), [])
    with open(config.prompts) as f, open(config.val_prompts) as g:
        train, val = [json.loads(x) for x in f], [json.loads(x) for x in g]
    assert len(val) == 64 and not {r["prompt"] for r in val} & {r["prompt"] for r in train}
    assert config.reward_fn == "math" and config.val_every and config.algorithm == "grpo"


@pytest.mark.parametrize("name", SMALL + LARGE)
def test_recipe_fits_at_its_stated_node_count(name, capsys):
    code, out, err = run_cli(recipe_plan_command(name), capsys)
    assert code == 0, err
    assert ": fits" in out


@pytest.mark.parametrize("name", LARGE)
def test_large_recipe_peaks_where_its_header_says_and_needs_bf16_and_tp8_engines(name,
                                                                                   capsys):
    args = recipe_plan_command(name)
    code, out, _ = run_cli(args, capsys)
    assert code == 0
    planned = float(re.search(r"peak ([\d.]+) GiB per GPU", out).group(1))
    with open(os.path.join(RECIPES, name)) as f:
        quoted = float(re.search(r"peak\s+#?\s*([\d.]+) GiB of the 72 usable", f.read()).group(1))
    assert quoted == planned
    # The trainer's defaults, fp32 and an engine per GPU, are refused for the rollout weights.
    for defaults in (["dtype=fp32"], ["layout.rollout.tensor_parallel=1"]):
        code, _, err = run_cli(args + defaults, capsys)
        assert code == 1 and "largest term: rollout weights" in err, (defaults, err)


# -- refusals --------------------------------------------------------------------------------

def test_a_70b_recipe_on_too_few_gpus_is_refused_naming_the_shortfall(capsys):
    args = recipe_plan_command("llama3-70b-grpo.yaml")
    args[args.index("--nodes") + 1] = "1"
    code, _, err = run_cli(args, capsys)
    assert code == 2
    assert "needs 64 GPUs (colocated 64) but 1 node(s) x 8 GPUs = 8: short by 56 GPUs" in err
    assert "use --nodes 8" in err


@pytest.mark.parametrize("overrides,extra,message", [
    (["tensor_parallel=16", "nproc=64"], [], "does not divide num_kv_heads=8"),
    (["tensor_parallel=16", "nproc=64"], [], "groups would span nodes of 8 GPUs"),
    (["tensor_parallel=8"], ["--gpus-per-node", "6"], "groups would span nodes of 6 GPUs"),
    (["pipeline_parallel=3", "nproc=24", "rollout_backend=vllm", "vllm_model_dir=hf"], [],
     "num_layers=32 is not divisible by pipeline_parallel"),
    (["nproc=12"], [], "nproc=12 is not a multiple of tensor_parallel x pipeline_parallel = 8"),
    (["max_new_tokens=8000"], [], "8512 tokens exceeds the model's max_position_embeddings=8192"),
])
def test_layouts_that_cannot_run_are_refused(overrides, extra, message, capsys):
    args = recipe_plan_command("llama3-8b-grpo.yaml")
    args[args.index("--nodes") + 1] = "8"
    code, _, err = run_cli(args[:1] + extra + args[1:] + overrides, capsys)
    assert code == 2 and message in err, err


def test_a_job_that_does_not_fit_names_the_largest_term_and_fixes_that_fit(capsys):
    args = recipe_plan_command("llama3-8b-ppo.yaml") + ["micro_batches=1"]
    code, out, err = run_cli(args, capsys)
    assert code == 1 and "DOES NOT FIT" in out
    assert "largest term: actor activations" in err
    # The Megatron engine needs PP=1, so the fixes are more ranks (on more nodes) or smaller
    # micro-batches; each suggestion is itself a plan that fits.
    fixes = re.findall(r"(\w+=\d+)(?: on --nodes (\d+))? \(peak", err)
    assert [f[0] for f in fixes] == ["nproc=16", "micro_batches=2"], err
    for change, nodes in fixes:
        fixed = list(args)
        if nodes:
            fixed[fixed.index("--nodes") + 1] = nodes
        code, out, _ = run_cli(fixed + [change], capsys)
        assert code == 0 and ": fits" in out


def test_disaggregated_placement_gives_each_group_its_own_gpus():
    from megarlhf.plan.job import Cluster, plan
    from megarlhf.configio import load_config
    from megarlhf.ppo.config import PPOConfig

    args = recipe_plan_command("llama3-8b-ppo.yaml")
    overrides = [a for a in args if "=" in a and not a.startswith("--")]
    config = load_config(PPOConfig, os.path.join(RECIPES, "llama3-8b-ppo.yaml"),
                         overrides + ["placement=disaggregated", "rollout_nproc=8"])
    result = plan(config, Cluster(nodes=4), 512)
    roles = {g.spec.name: {t.role for t in g.terms} for g in result.groups}
    assert roles == {"actor": {"actor"}, "critic": {"critic"}, "ref+reward": {"ref", "reward"},
                     "rollout": {"rollout"}}
    assert [g.first_gpu for g in result.groups] == [0, 8, 16, 24]
    # The rollout ranks hold the whole model in fp32 (TP1 engines), the actor's ranks their
    # TP8 shard; in bf16 with TP8 engines, both hold a bf16 TP8 shard.
    model = preset("llama3-8b")
    tp8 = rank_params(model, ParallelConfig(tensor_parallel=8), 0)
    assert weights_per_group(result) == {"rollout": 4 * total_params(model), "actor": 4 * tp8}
    bf16 = plan(dataclasses.replace(config, dtype="bf16", layout=rollout_tp(8)),
                Cluster(nodes=4), 512)
    assert weights_per_group(bf16) == {"rollout": 2 * tp8, "actor": 2 * tp8}


def weights_per_group(result) -> dict[str, int]:
    """Resident weight bytes of the actor's and the rollout group's most loaded ranks."""
    return {g.spec.name: sum(t.bytes for t in g.terms if t.what == "weights")
            for g in result.groups if g.spec.name in ("actor", "rollout")}


# -- where shapes come from ------------------------------------------------------------------

def fake_checkpoint(path, model, *, value_head: bool) -> str:
    """A directory with only a completion marker: all the planner and dry runs read."""
    from megarlhf.engine.checkpoint import COMPLETE_MARKER

    os.makedirs(path)
    with open(os.path.join(path, COMPLETE_MARKER), "w") as f:
        json.dump({"model": model.to_dict(), "value_head": value_head, "layout": {},
                   "with_optimizer": False, "dtype": "fp32", "architecture": None,
                   "extra": {}}, f)
    return str(path)


def test_model_shapes_come_from_checkpoints_hf_configs_and_presets(tmp_path):
    from megarlhf.models.arch import architecture
    from megarlhf.plan.sources import resolve

    qwen = preset("qwen2.5-72b")
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps(
        {**architecture("qwen2").hf_config(qwen), "architectures": ["Qwen2ForCausalLM"]}))
    from_hf = resolve(str(hf), field="actor", value_head=False)
    assert from_hf.origin == "HF config" and from_hf.model.qkv_bias
    assert total_params(from_hf.model) == total_params(qwen)

    critic = fake_checkpoint(tmp_path / "critic", preset("tiny"), value_head=True)
    assert resolve(critic, field="critic", value_head=True).model == preset("tiny")
    with pytest.raises(ValueError, match="has a value head, the role needs an LM head"):
        resolve(critic, field="actor", value_head=False)
    assert resolve("preset:llama3-70b", field="actor", value_head=False).model \
        == preset("llama3-70b")
    with pytest.raises(ValueError, match="does not exist yet.*plan with actor=preset:NAME"):
        resolve(str(tmp_path / "nothing"), field="actor", value_head=False)


# -- --dry-run -------------------------------------------------------------------------------

def forbid(*_, **__):
    raise AssertionError("a dry run got past its checks into real work")


def test_plan_dry_run_checks_but_computes_nothing(monkeypatch, capsys):
    from megarlhf.plan import job

    monkeypatch.setattr(job, "_group_at", forbid)
    args = recipe_plan_command("llama3-70b-ppo.yaml")
    code, out, err = run_cli(args + ["--dry-run"], capsys)
    assert code == 0 and out.startswith("dry run:"), err
    args[args.index("--nodes") + 1] = "2"
    code, _, err = run_cli(args + ["--dry-run"], capsys)
    assert code == 2 and "short by 112 GPUs" in err


def test_ppo_dry_run_checks_paths_and_shapes_and_starts_nothing(tmp_path, monkeypatch, capsys):
    from megarlhf.ppo import controller, placement

    monkeypatch.setattr(controller, "run", forbid)
    monkeypatch.setattr(placement.Placement, "__init__", forbid)
    tiny = preset("tiny")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": [1] * n}) + "\n" for n in (3, 9, 5)))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump({
        "actor": fake_checkpoint(tmp_path / "actor", tiny, value_head=False),
        "reward_model": fake_checkpoint(tmp_path / "rm", tiny, value_head=True),
        "prompts": str(prompts), "out_dir": str(tmp_path / "out"), "nproc": 4,
        "tensor_parallel": 2, "algorithm": "grpo", "samples_per_prompt": 2}))
    code, out, _ = run_cli(["ppo", "--config", str(recipe), "--dry-run"], capsys)
    assert code == 0
    assert "dry run: would run grpo for 10 steps (from step 0), 3 prompts (longest 9 tokens)" \
        in out and "group colocated: 4 local rank(s), TP2 x PP1" in out
    for bad, message in ((["tensor_parallel=4"], "tensor_parallel=4 does not divide "
                                                 "num_kv_heads=2"),
                         (["max_new_tokens=250"], "prompts.jsonl:2: a prompt of 9 tokens + "
                                                  "max_new_tokens=250 does not fit"),
                         ([f"actor={tmp_path}/none"], "none does not exist")):
        code, _, err = run_cli(["ppo", "--config", str(recipe), "--dry-run", *bad], capsys)
        assert code == 2 and message in err, err


def test_sft_dry_run_checks_data_and_layout_and_starts_nothing(tmp_path, monkeypatch, capsys):
    from megarlhf.configio import to_dict
    from megarlhf.data import synthetic
    from megarlhf.data.config import DataConfig, DatasetSource
    from megarlhf.data.tokenizer import train_sentencepiece
    from megarlhf.sft import command
    from megarlhf.sft.config import LoopConfig, ModelSource, SFTConfig

    monkeypatch.setattr(command, "launch_local", forbid)
    monkeypatch.setitem(command.STAGES, "sft", command.STAGES["sft"][:2] + (forbid,))
    data = DataConfig(
        train=DatasetSource(path=synthetic.write_jsonl(synthetic.sft_records(20),
                                                       str(tmp_path / "sft.jsonl"))),
        tokenizer=train_sentencepiece(synthetic.tokenizer_corpus(), str(tmp_path / "sp.model"),
                                      vocab_size=256), max_length=48)
    cfg = SFTConfig(model=ModelSource(preset="tiny"), data=data,
                    train=LoopConfig(output_dir=str(tmp_path / "out"), steps=3,
                                     global_batch_size=8, micro_batch_size=2),
                    parallel=ParallelConfig(tensor_parallel=2))
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(to_dict(cfg)))
    code, out, _ = run_cli(["sft", "--config", str(path), "--nproc", "4", "--dry-run"], capsys)
    assert code == 0 and "dry run: would train sft for 3 steps (from step 0) on 4 rank(s) at " \
        "TP2 x PP1 x DP2, 2 micro-batch(es) of 2 per step; 20 training examples" in out
    code, _, err = run_cli(["sft", "--config", str(path), "--nproc", "3", "--dry-run"], capsys)
    assert code == 2 and "world size 3 is not divisible" in err


@pytest.mark.parametrize("name", LARGE)
def test_large_recipe_preflight_on_checkpoint_metadata_takes_seconds(name, tmp_path, capsys):
    """`megarlhf ppo --dry-run` of a 70B recipe at its planned layout, with checkpoints that
    hold only their metadata: every pre-spawn check runs, without a weight or a GPU."""
    with open(os.path.join(RECIPES, name)) as f:
        recipe = yaml.safe_load(f)
    shape = preset("qwen2.5-72b" if name.startswith("qwen") else "llama3-70b")
    for field, value_head in (("actor", False), ("critic", True), ("reward_model", True)):
        if recipe.get(field):
            recipe[field] = fake_checkpoint(tmp_path / field, shape, value_head=value_head)
    vllm_dir = tmp_path / "hf"
    vllm_dir.mkdir()
    (vllm_dir / "config.json").write_text("{}")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": list(range(1, 513))}) + "\n"
                               for _ in range(4 * recipe["prompts_per_step"])))
    recipe.update(prompts=str(prompts), vllm_model_dir=str(vllm_dir),
                  out_dir=str(tmp_path / "out"))
    path = tmp_path / name
    path.write_text(yaml.safe_dump(recipe))
    start = time.perf_counter()
    code, out, err = run_cli(["ppo", "--config", str(path), "--dry-run"], capsys)
    seconds = time.perf_counter() - start
    assert code == 0, err
    assert f"dry run: would run {recipe['algorithm']} for {recipe['steps']} steps" in out
    assert seconds < 10, seconds  # measured ~0.1 s; the bound only says "seconds, not minutes"
    assert not os.path.exists(tmp_path / "out")  # a dry run writes nothing
