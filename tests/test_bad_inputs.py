"""The bad-input catalogue: mistakes users make, each refused before any rank starts (or, for
corruption, when it is met) with exit code 2, one or two lines on stderr naming the field or
path, no traceback, and every file that existed before unchanged.

Cases run through the real commands (`megarlhf ppo`, with and without --dry-run, `megarlhf
plan`, `megarlhf sft`/`rm`) in this process; starting a rank fails the test. The converters'
cases are in tests/test_output_safety.py and tests/test_integrity.py.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil

import pytest
import torch
import yaml

from megarlhf.cli import main as cli
from megarlhf.engine.checkpoint import COMPLETE_MARKER
from megarlhf.metrics import MetricsLog
from megarlhf.models.lora import LoraConfig
from megarlhf.parallel.mesh import ParallelConfig
from megarlhf.ppo import checkpoints, run_dir
from megarlhf.ppo.config import PPOConfig
from megarlhf.ppo.data import read_run_prompts
from megarlhf.ppo.rewards import RewardFnError, RewardFunction
from megarlhf.rewards.calls import Sample

# ------------------------------------------------------------------------------ the world


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Toy checkpoints (actor, critic, a second actor, a reward model and a language model of
    another vocabulary), its HF directory, a prompts file and a recipe that passes every
    check."""
    from megarlhf.convert.hf_to_mcore import hf_to_mcore
    from tests import hf_models

    root = tmp_path_factory.mktemp("world")
    hf = hf_models.save_model(str(root / "hf"), "llama")
    hf_to_mcore(hf, str(root / "actor"), parallel=ParallelConfig())
    hf_to_mcore(hf, str(root / "critic"), parallel=ParallelConfig(), role="critic",
                init_value_head=True)
    other = hf_models.save_model(str(root / "hf_other"), "llama", seed=1)
    hf_to_mcore(other, str(root / "actor_other"), parallel=ParallelConfig())
    small = hf_models.save_model(str(root / "hf_small"), "llama", vocab_size=280)
    hf_to_mcore(small, str(root / "rm_small"), parallel=ParallelConfig(), role="reward",
                init_value_head=True)
    hf_to_mcore(small, str(root / "lm_small"), parallel=ParallelConfig())
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": [5 + i, 6, 7]}) + "\n"
                               for i in range(8)))
    recipe = {"actor": str(root / "actor"), "prompts": str(prompts),
              "out_dir": str(root / "out"), "algorithm": "grpo", "samples_per_prompt": 2,
              "reward_fn": "tests.ppo_tasks:low_token_fraction", "steps": 2}
    (root / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    return root


@pytest.fixture(autouse=True)
def no_rank_starts(monkeypatch):
    from megarlhf.parallel import launcher
    from megarlhf.ppo import placement
    from megarlhf.sft import command

    def spawned(*args, **kwargs):
        raise AssertionError("a rank was started: the mistake was not caught before spawning")

    monkeypatch.setattr(placement.Placement, "__init__", spawned)
    monkeypatch.setattr(launcher, "launch_local", spawned)
    monkeypatch.setattr(command, "launch_local", spawned)


def tree(root) -> dict[str, str]:
    out = {}
    for base, _, files in os.walk(root):
        for name in files:
            path = os.path.join(base, name)
            with open(path, "rb") as f:
                out[path] = hashlib.sha256(f.read()).hexdigest()
    return out


def refused(argv: list[str], capsys, root, *, names: str, code: int = 2) -> str:
    """Run the command; assert it exits `code` with a short stderr naming `names`, without a
    traceback, and that no file that existed before changed. Returns stderr."""
    before = tree(root)
    with pytest.raises(SystemExit) as exit_:
        cli(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == code, err
    assert "Traceback" not in err and names in err, err
    message = [line for line in err.splitlines() if not line.startswith(("INFO", "WARNING"))]
    assert message and message[0].startswith("error: "), err
    after = tree(root)
    assert {p: h for p, h in after.items() if p in before} == before
    return err


def ppo(world, *overrides, dry_run: bool):
    return ["ppo", "--config", str(world / "recipe.yaml"), *(["--dry-run"] if dry_run else []),
            *overrides]


def test_the_base_recipe_passes_the_dry_run(world, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli(ppo(world, dry_run=True))
    assert exit_.value.code == 0, capsys.readouterr().err
    assert "dry run: would run grpo for 2 steps (from step 0), 8 prompts" in \
        capsys.readouterr().out


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_a_python_tool_passes_its_escape_probe_before_launch(world, capsys, monkeypatch):
    """With the python tool the dry run runs the sandbox's escape probe (and passes it); a
    sandbox that leaks is refused in one line naming the leaks."""
    from megarlhf.envs import python_tool

    tools = ["environment=tools", "tools=[python]"]
    with pytest.raises(SystemExit) as exit_:
        cli(ppo(world, dry_run=True) + tools)
    assert exit_.value.code == 0, capsys.readouterr().err
    monkeypatch.setattr(python_tool, "escape_probe",
                        lambda sandbox: (["it read a file outside it (/x)"], "PROBED"))
    refused(ppo(world, dry_run=True) + tools, capsys, world,
            names="tools: the python sandbox leaks here: it read a file outside it (/x)")


# ------------------------------------------------------------ config values, both commands

CONFIG_CASES = [  # (overrides, what the message must name)
    (["actr=x"], "actr"),
    (["steps=abc"], "steps"),
    (["algorithm=ppo2"], "algorithm='ppo2'"),
    (["top_p=0"], "top_p=0.0 is out of range"),
    (["top_p=1.5"], "top_p=1.5 is out of range"),
    (["temperature=-1"], "temperature=-1.0 is out of range"),
    (["temperature=.nan"], "temperature=nan is out of range"),
    (["gamma=1.5"], "gamma=1.5 is out of range"),
    (["lam=-0.1"], "lam=-0.1 is out of range"),
    (["clip_eps=0"], "clip_eps=0.0 is out of range"),
    (["actor_lr=-1e-5"], "actor_lr=-1e-05 is out of range"),
    (["actor_lr=.inf"], "actor_lr=inf is out of range"),
    (["critic_lr=0"], "critic_lr=0.0 is out of range"),
    (["save_every=-1"], "save_every=-1 is out of range"),
    (["restart_window_steps=0"], "restart_window_steps=0 is out of range"),
    (["kl_coef=-0.1"], "kl_coef=-0.1 is out of range"),
    (["distill_coef=0.5"], "needs teacher=CKPT"),
    (["teacher_by_source={a: ''}", "algorithm=opd", "reward_fn=null"],
     "teacher_by_source.a must name a teacher"),
    # A teacher on ranks of its own: disaggregated, with a teacher, at a layout its ranks hold.
    (["teacher_nproc=2", "algorithm=opd", "reward_fn=null", "teacher=t"],
     "teacher_nproc=2 needs placement=disaggregated; a colocated teacher runs on the nproc "
     "training ranks"),
    (["teacher_nproc=2", "placement=disaggregated"],
     "teacher_nproc=2 is set, but no teacher (or teacher_by_source): unset it"),
    (["teacher_nproc=3", "placement=disaggregated", "algorithm=opd", "reward_fn=null",
      "teacher=t", "layout={teacher: {tensor_parallel: 2}}"],
     "teacher_nproc=3 is not a multiple of layout.teacher's tensor_parallel x "
     "pipeline_parallel x context_parallel = 2"),
    (["layout={teacher: {tensor_parallel: 2}}", "algorithm=opd", "reward_fn=null", "teacher=t"],
     "layout.teacher is set, but without teacher_nproc the teachers run in the actor's "
     "group, in its layout: set teacher_nproc"),
    (["teacher_backend=vllm", "algorithm=opd", "reward_fn=null", "teacher=t"],
     "teacher_backend=vllm runs the teachers on ranks of their own: set teacher_nproc"),
    (["teacher_backend=vllm"], "teacher_backend=vllm is set, but there is no teacher"),
    # Agent programs: one way to run episodes, in the rollout modes a test ran.
    (["agent=tests.agent_programs:two_calls", "environment=tools", "tools=[python]"],
     "agent and environment are two ways to run episodes; set one"),
    (["agent_timeout=30"], "agent_timeout apply to agent programs; set agent=module:function"),
    (["agent=tests.agent_programs:two_calls", "agent_timeout=0"],
     "agent_timeout=0.0 is out of range"),
    (["agent=tests.agent_programs:two_calls", "max_observation_tokens=8"],
     "max_observation_tokens apply to an environment's episodes; an agent's read only "
     "max_turns and tool_parser: leave them unset"),
    (["teacher_backend=sglang"], "teacher_backend='sglang' is not one of"),
    (["seed=-1"], "seed=-1 is out of range"),
    (["top_k=-1"], "top_k=-1 is out of range"),
    (["entropy_coef=-1"], "entropy_coef=-1.0 is out of range"),
    (["keep_last=0"], "keep_last must be >= 1"),
    (["steps=0"], "steps must be >= 1"),
    (["nproc=3", "tensor_parallel=2"], "nproc=3 is not a multiple"),
    (["nproc=3", "tensor_parallel=3"], "tensor_parallel=3"),
    (["algorithm=ppo"], "needs a critic checkpoint"),
    (["samples_per_prompt=1"], "samples_per_prompt >= 2"),
    (["resume_allow_changes=[bogus]"], "resume_allow_changes: 'bogus'"),
    (["logprob_gap_limit=-1"], "logprob_gap_limit must be > 0"),
    (["logprob_gap_max_limit=0"], "logprob_gap_max_limit must be > 0"),
    (["rollout_backend=vllm"], "needs vllm_model_dir"),
    (["sync_mode=delta"], "sync_mode=delta needs placement=disaggregated"),
    (["sync_mode=diff"], "sync_mode='diff' is not one of"),
    (["placement=disaggregated", "sync_mode=delta", "worker_group=ray"],
     "sync_mode=delta is not tested under worker_group=ray yet"),
    (["placement=disaggregated", "sync_mode=delta", "nproc=2", "pipeline_parallel=2"],
     "sync_mode=delta is not tested with the actor's pipeline_parallel > 1 yet"),
    (["placement=disaggregated", "delta_full_every=0"], "delta_full_every=0 is out of range"),
    (["max_engine_restarts=-1"], "max_engine_restarts=-1 is out of range"),
    (["max_staleness=1.5"], "max_staleness must be int, got 1.5"),
    (["stale_groups=later"], "stale_groups='later' is not one of ['wait', 'drop']"),
    # retired: refused whatever its value, naming the field that replaced it
    (["async_rollout=true"], "async_rollout is retired: set rollout_mode: one_step_off"),
    (["async_rollout=false"], "async_rollout is retired: set rollout_mode: one_step_off"),
    (["rollout_gpu_memory_utilization=1.5"], "rollout_gpu_memory_utilization must be in"),
    (["dtype=bf16", "layout={actor: {lora: {rank: 4}}}"],
     "layout.actor.lora with dtype=bf16: the engines get the merged weights rounded to bf16, "
     "behind the trainer's adapters; set rollout_correction=tis (or mis), or dtype=fp32"),
    # multi-turn episodes (megarlhf/envs)
    (["environment=tests.env_fns:Missing"], "environment 'tests.env_fns:Missing' cannot be "
                                            "loaded: AttributeError"),
    (["environment=tests.env_fns:WrongStep"], "step(self) cannot be called as step(self, "
                                              "response)"),
    (["environment=tests.env_fns:Scripted", "env_args={turn: 3}"],
     "env_args ['turn'] do not fit environment"),
    (["environment=tests.env_fns:Failing", "env_args={at: 0}"],
     "failed in reset() at"),
    (["environment=arithmetic_retry", "max_turn_tokens=100"],
     "max_turn_tokens=100 must be in [1, max_new_tokens=16]"),
    (["max_turns=3"], "max_turns apply to multi-turn episodes; set environment="),
    (["environment=tools"], "environment=tools needs tools=[module:function, ...]"),
    (["environment=tools", "tools=[tests.env_fns:untyped]"],
     "no JSON schema for tests.env_fns:untyped: Argument x is missing a type hint"),
    (["environment=arithmetic_retry", "env_workers=0"], "env_workers must be >= 1, got 0"),
    (["environment=tools", "tools=[python]", "tool_python_workers=0"],
     "tool_python_workers must be >= 1 or None"),
    (["environment=arithmetic_retry", "on_env_error=ignore"],
     "on_env_error='ignore' is not one of ['stop', 'drop']"),
    (["environment=arithmetic_retry", "on_env_error=zero_reward"],
     "on_env_error=zero_reward is retired: it trained a failed episode as reward 0; use drop"),
    (["reward_max_timeout_fraction=0.5"],
     "reward_max_timeout_fraction is retired: a sample without a score is masked now; "
     "max_failed_reward_fraction bounds their share"),
    (["reward_judge={model: m, template: t, failure_score: 0}"],
     "reward_judge: failure_score is retired: a verdict that cannot be read gives no score"),
    (["max_failed_reward_fraction=1.5"], "max_failed_reward_fraction=1.5 is out of range"),
    (["tool_parser=nope"], "tool_parser='nope' is not one of"),
    (["reward_url=ftp://rm/score"], "reward_url='ftp://rm/score' is not an http:// or https://"),
    (["reward_url_headers_env=RM"], "reward_url_headers_env is set, but no reward_url"),
    (["reward_url=http://rm/x", "reward_url_format=grpc"], "reward_url_format='grpc' is not"),
    (["rewards=[{name: a, kind: math}]"], "reward_fn / reward_fn_by_source and rewards are "
                                          "both set"),
    (["reward_fn=null", "rewards=[{name: a, kind: math}, {name: a, kind: exact_match}]"],
     "rewards: names ['a', 'a'] repeat"),
    (["reward_fn=null", "rewards=[{name: j, kind: judge}]"], "rewards[0] (j): kind judge "
                                                            "needs reward_judge set"),
    (["reward_fn=null", "rewards=[{name: j, kind: jury}]"], "rewards[0] (j): kind='jury' is "
                                                           "not one of"),
    (["reward_fn=null", "reward_judge={model: m, template: t, verdict: maybe}"],
     "reward_judge.verdict='maybe' is not one of"),
    (["reward_fn=null", "rewards=[{name: f, kind: fn}]"], "'function' goes with kind fn"),
    (["reward_fn=null", "rewards=[{name: u, kind: url}]"], "kind url needs reward_url set"),
    (["reward_fn=null", "reward_url=http://127.0.0.1:1/x", "rewards=[{name: a, kind: math}]"],
     "reward_url is set, but no rewards term of kind url uses it"),
    (["reward_fn=null", "rewards=[{name: a b, kind: math}]"], "rewards[0].name='a b'"),
    (["reward_fn=null", "rewards=[{name: mean, kind: math}]"], "rewards: names ['mean'] are "
                                                              "metrics the run logs itself"),
    (["reward_fn=null", "reward_url=http://127.0.0.1:1/x", "reward_url_check=false",
      "rewards=[{name: a, kind: url}, {name: b, kind: url}]"],
     "rewards: more than one term of kind url"),
]


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "run"])
@pytest.mark.parametrize("overrides,names", CONFIG_CASES, ids=[c[0][0] for c in CONFIG_CASES])
def test_a_bad_config_value_is_refused(world, capsys, overrides, names, dry_run):
    refused(ppo(world, *overrides, dry_run=dry_run), capsys, world, names=names)


# ----------------------------------------------------------------------- paths and files

def path_cases(world) -> dict[str, tuple[list[str], str]]:
    """name -> (overrides, what the message must name); files made on demand."""
    bad_json = world / "bad.jsonl"
    bad_json.write_text('{"prompt_ids": [5, 6]}\n{"prompt_ids": [5,\n')
    empty = world / "empty.jsonl"
    empty.write_text("")
    out_of_vocab = world / "vocab.jsonl"
    out_of_vocab.write_text('{"prompt_ids": [5]}\n{"prompt_ids": [5]}\n{"prompt_ids": [7, 300]}\n')
    overlong = world / "long.jsonl"
    overlong.write_text('{"prompt_ids": [5]}\n' + json.dumps({"prompt_ids": [5] * 250}) + "\n")
    a_file = world / "a_file"
    a_file.write_text("mine")
    no_config = world / "not_hf"
    no_config.mkdir(exist_ok=True)
    # The actor's HF directory with one special token renamed: same vocabulary size, same
    # weights, another tokenizer.
    special = world / "hf_special"
    if not special.exists():
        shutil.copytree(world / "hf", special)
        tokenizer = json.loads((special / "tokenizer.json").read_text())
        tokenizer["added_tokens"][-1]["content"] = "<|eos|>"
        (special / "tokenizer.json").write_text(json.dumps(tokenizer))
    weightless = world / "hf_weightless"  # the actor's HF directory without its weights
    if not weightless.exists():
        shutil.copytree(world / "hf", weightless,
                        ignore=shutil.ignore_patterns("*.safetensors"))
    opd = ["algorithm=opd", "reward_fn=null"]
    return {
        "actor missing": ([f"actor={world}/nothing"], f"{world}/nothing does not exist"),
        "actor is an HF dir": ([f"actor={world}/hf"], "is an HF model directory"),
        "actor is a value checkpoint": ([f"actor={world}/critic"], "has a value head"),
        "critic is an LM checkpoint": (["algorithm=ppo", f"critic={world}/actor"],
                                       "critic: checkpoint"),
        "prompts missing": ([f"prompts={world}/none.jsonl"], "none.jsonl does not exist"),
        "prompts bad JSON": ([f"prompts={bad_json}"], "bad.jsonl:2"),
        "prompts empty": ([f"prompts={empty}"], "empty.jsonl has no usable prompts"),
        "prompt ids outside the vocabulary": ([f"prompts={out_of_vocab}"], "vocab.jsonl:3"),
        "prompt longer than the positions": ([f"prompts={overlong}"], "long.jsonl:2"),
        "reward_fn module missing": (["reward_fn=nomodule:f"], "reward_fn 'nomodule:f'"),
        "agent module missing": (["agent=nomodule:f"], "agent 'nomodule:f' cannot be loaded"),
        "agent not async": (["agent=tests.agent_programs:_question"],
                            "agent 'tests.agent_programs:_question' must be an async function"),
        "reward_fn not module:function": (["reward_fn=justaname"], "reward_fn 'justaname'"),
        "reward_fn not callable": (["reward_fn=tests.ppo_tasks:__doc__"], "is not callable"),
        "reward model of another vocabulary": ([f"reward_model={world}/rm_small"],
                                               "reward_model: its vocabulary has 280"),
        "teacher of another tokenizer": (["algorithm=opd", "reward_fn=null",
                                          f"teacher={world}/lm_small"],
                                         "teacher: its vocabulary has 280"),
        "teacher_by_source of another vocabulary": (
            [*opd, f"teacher={world}/hf", f"teacher_by_source={{a: {world}/hf_small}}"],
            "teacher_by_source.a: its vocabulary has 280"),
        "teacher_by_source of other special tokens": (
            [*opd, f"teacher={world}/hf", f"teacher_by_source={{a: {special}}}"],
            "teacher_by_source.a: its tokenizer files differ from the actor's"),
        "teacher on its own ranks at a TP its heads do not split": (
            [*opd, f"teacher={world}/actor_other", "placement=disaggregated", "teacher_nproc=4",
             "layout={teacher: {tensor_parallel: 4}}"],
            "teacher: tensor_parallel=4 does not divide num_kv_heads=2"),
        "teacher HF dir without weights": ([*opd, f"teacher={weightless}"],
                                           "teacher: no model.safetensors or model."
                                           "safetensors.index.json in " + str(weightless)),
        "teacher_by_source missing": ([*opd, f"teacher_by_source={{a: {world}/nothing}}"],
                                      f"teacher_by_source.a: {world}/nothing does not "
                                      "exist"),
        "vLLM teacher from a checkpoint": (
            [*opd, f"teacher={world}/actor_other", "placement=disaggregated",
             "teacher_nproc=1", "teacher_backend=vllm"],
            f"teacher: {world}/actor_other is a megarlhf checkpoint; teacher_backend=vllm "
            f"reads an HF directory: export it"),
        "a source without a teacher": ([*opd, f"teacher_by_source={{a: {world}/actor_other}}"],
                                       "teacher_by_source maps no teacher for the prompts of "
                                       "data source(s) (none)"),
        "out_dir is a file": ([f"out_dir={a_file}"], f"out_dir {a_file}"),
        "out_dir under a file": ([f"out_dir={a_file}/run"], f"{a_file} is a file"),
        "vllm_model_dir without config.json": (["rollout_backend=vllm",
                                                f"vllm_model_dir={no_config}"],
                                               "has no config.json"),
        "stop ids outside the vocabulary": (["stop_token_ids=[2,999]"], "stop_token_ids [999]"),
        "rollout_max_model_len too short": (["rollout_backend=vllm", f"vllm_model_dir={world}/hf",
                                             "rollout_max_model_len=17"],
                                            "rollout_max_model_len=17"),
        # Port 1 of this machine: nothing listens there.
        "reward server unreachable": (["reward_url=http://127.0.0.1:1/score"],
                                      "reward_url http://127.0.0.1:1/score: cannot connect to "
                                      "127.0.0.1:1"),
        "reward_url headers variable unset": (["reward_url=http://127.0.0.1:1/score",
                                               "reward_url_headers_env=MEGARLHF_UNSET_HEADERS"],
                                              "MEGARLHF_UNSET_HEADERS is not set"),
    }


PATH_CASES = ["actor missing", "actor is an HF dir", "actor is a value checkpoint",
              "critic is an LM checkpoint", "prompts missing", "prompts bad JSON",
              "prompts empty", "prompt ids outside the vocabulary",
              "prompt longer than the positions", "reward_fn module missing",
              "agent module missing", "agent not async",
              "reward_fn not module:function", "reward_fn not callable",
              "reward model of another vocabulary", "teacher of another tokenizer",
              "teacher_by_source of another vocabulary",
              "teacher_by_source of other special tokens",
              "teacher on its own ranks at a TP its heads do not split",
              "teacher HF dir without weights",
              "teacher_by_source missing",
              "a source without a teacher", "vLLM teacher from a checkpoint",
              "out_dir is a file",
              "out_dir under a file", "vllm_model_dir without config.json",
              "stop ids outside the vocabulary", "rollout_max_model_len too short",
              "reward server unreachable", "reward_url headers variable unset"]


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "run"])
@pytest.mark.parametrize("case", PATH_CASES)
def test_a_bad_path_or_file_is_refused(world, capsys, case, dry_run):
    overrides, names = path_cases(world)[case]
    refused(ppo(world, *overrides, dry_run=dry_run), capsys, world, names=names)


def test_a_run_rewarded_by_rewards_terms_alone_passes_the_dry_run(world, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli(ppo(world, "reward_fn=null", "rewards=[{name: low, kind: fn, function: "
                "tests.ppo_tasks:low_token_fraction, weight: 2}]", dry_run=True))
    assert exit_.value.code == 0, capsys.readouterr().err


def test_reward_url_check_false_lets_a_run_start_before_its_reward_server(world, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli(ppo(world, "reward_url=http://127.0.0.1:1/score", "reward_url_check=false",
                dry_run=True))
    assert exit_.value.code == 0, capsys.readouterr().err


def test_skip_overlong_drops_what_does_not_fit_and_says_so(world, capsys):
    path_cases(world)
    with pytest.raises(SystemExit) as exit_:
        cli(ppo(world, f"prompts={world}/long.jsonl", "skip_overlong=true", dry_run=True))
    assert exit_.value.code == 0
    assert "1 prompts (1 overlong dropped)" in capsys.readouterr().out


@pytest.mark.parametrize("recipe,names", [
    ("nomodule:recipe", "nomodule"),
    ("missing.yaml", "missing.yaml"),
    ("syntax.yaml", "syntax.yaml:2"),
    ("list.yaml", "must hold a mapping"),
])
def test_a_bad_recipe_is_refused(world, capsys, recipe, names):
    (world / "syntax.yaml").write_text("actor: a\n  prompts: [unclosed\n")
    (world / "list.yaml").write_text("- actor\n")
    path = str(world / recipe) if recipe.endswith(".yaml") else recipe
    refused(["ppo", "--config", path], capsys, world, names=names)


def test_a_recipe_holding_a_retired_key_is_refused_in_one_line(world, capsys):
    recipe = yaml.safe_load((world / "recipe.yaml").read_text())
    path = world / "retired.yaml"
    path.write_text(yaml.safe_dump({**recipe, "async_rollout": False}))
    err = refused(["ppo", "--config", str(path)], capsys, world, names="async_rollout")
    assert err.splitlines() == [f"error: {path}: async_rollout is retired: set rollout_mode: "
                                f"one_step_off (or sync)"]


def test_an_out_dir_held_by_a_live_run_is_refused(world, capsys):
    claim = run_dir.Claim(str(world / "busy"))
    try:
        for dry_run in (True, False):
            err = refused(ppo(world, f"out_dir={world}/busy", dry_run=dry_run), capsys, world,
                          names="is in use by a live run")
            assert f"pid {os.getpid()}" in err
    finally:
        claim.release()
    run_dir.check_out_dir(str(world / "busy"))  # released: free again


def test_a_bad_library_log_level_is_refused(world, capsys, monkeypatch):
    monkeypatch.setenv("MEGARLHF_LIBRARY_LOGS", "loud")
    for dry_run in (True, False):
        refused(ppo(world, dry_run=dry_run), capsys, world,
                names="MEGARLHF_LIBRARY_LOGS='loud': expected one of error, warning, info, debug")


# ----------------------------------------------------------------------------- resume

def _fake_checkpoint(world, out: str, **changed) -> None:
    """out/checkpoints/step_2 recording the base recipe's inputs with `changed` fields."""
    with open(world / "recipe.yaml") as f:
        fields = {**yaml.safe_load(f), "out_dir": out, **changed}
    step = checkpoints.of_run(out).path(2)
    os.makedirs(step)
    config = PPOConfig(**fields)
    inputs = run_dir.run_inputs(config, read_run_prompts(config)[0])
    with open(os.path.join(step, checkpoints.STATE), "w") as f:
        json.dump({"step": 2, "sampler": {"consumed": 16}, "kl": {}, "inputs": inputs}, f)


@pytest.mark.parametrize("field,value", [
    ("seed", 7), ("algorithm", "rloo"), ("actor", "actor_other"), ("prompts", "other.jsonl")])
def test_resume_with_other_inputs_is_refused_and_can_be_allowed(world, capsys, tmp_path,
                                                                field, value):
    other = world / "other.jsonl"
    other.write_text('{"prompt_ids": [9, 9]}\n')
    if field in ("actor", "prompts"):
        value = str(world / value)
    out = str(tmp_path / "out")
    _fake_checkpoint(world, out, **{field: value})
    for dry_run in (True, False):
        err = refused(ppo(world, f"out_dir={out}", dry_run=dry_run), capsys, tmp_path,
                      names=f"{field}: checkpoint")
        assert f"resume_allow_changes=[{field}]" in err
    with pytest.raises(SystemExit) as exit_:
        cli(ppo(world, f"out_dir={out}", f"resume_allow_changes=[{field}]", dry_run=True))
    assert exit_.value.code == 0 and "resuming from" in capsys.readouterr().out


def test_each_teacher_is_a_resume_input(world, tmp_path):
    """`teacher` (here an HF directory: its files and sampled weights) and each
    teacher_by_source teacher (here a checkpoint: its metadata) are recorded: a moved copy of
    the HF teacher resumes; other weights of the same shapes, another checkpoint for a source,
    or another source mapped stop the run naming that field alone, unless allowed."""
    def inputs(teacher, by_source: dict) -> dict:
        config = PPOConfig(actor=str(world / "actor"), prompts=str(world / "prompts.jsonl"),
                           out_dir=str(tmp_path / "out"), algorithm="opd", teacher=str(teacher),
                           teacher_by_source={s: str(p) for s, p in by_source.items()})
        return run_dir.run_inputs(config, [])

    recorded = inputs(world / "hf", {"b": world / "actor_other"})
    moved = shutil.copytree(world / "hf", tmp_path / "moved")
    run_dir.check_resume("step_2", recorded, inputs(moved, {"b": world / "actor_other"}), ())
    for field, now in (("teacher", inputs(world / "hf_other", {"b": world / "actor_other"})),
                       ("teacher_by_source", inputs(world / "hf", {"b": world / "actor"})),
                       ("teacher_by_source", inputs(world / "hf", {"c": world / "actor_other"}))):
        with pytest.raises(ValueError, match=rf"\n  {field}: checkpoint .* vs now .*\n.*"
                                             rf"resume_allow_changes=\[{field}\]"):
            run_dir.check_resume("step_2", recorded, now, ())
        run_dir.check_resume("step_2", recorded, now, (field,))


def test_a_moved_but_identical_actor_resumes(world, capsys, tmp_path):
    out = str(tmp_path / "out")
    _fake_checkpoint(world, out)
    shutil.copytree(world / "actor", tmp_path / "actor_moved")
    with pytest.raises(SystemExit) as exit_:
        cli(ppo(world, f"out_dir={out}", f"actor={tmp_path}/actor_moved", dry_run=True))
    assert exit_.value.code == 0, capsys.readouterr().err


def test_a_resume_with_other_lora_settings_is_refused(world, capsys, tmp_path):
    """The checkpoint's actor trained every weight: resuming it with adapters is refused, and
    one that trained adapters cannot resume without them or with another rank."""
    out = str(tmp_path / "out")
    _fake_checkpoint(world, out)
    actor = os.path.join(checkpoints.of_run(out).path(2), "actor")
    shutil.copytree(world / "actor", actor)
    for dry_run in (True, False):
        refused(ppo(world, f"out_dir={out}", "layout.actor.lora.rank=4", dry_run=dry_run),
                capsys, tmp_path, names="it trained every weight (no LoRA), layout.actor.lora "
                                        "now gives adapters {'rank': 4")
    with open(os.path.join(actor, COMPLETE_MARKER)) as f:
        meta = json.load(f)
    with open(os.path.join(actor, COMPLETE_MARKER), "w") as f:
        json.dump({**meta, "lora": LoraConfig(rank=8).to_dict()}, f)
    for lora in ([], ["layout.actor.lora.rank=4"]):
        refused(ppo(world, f"out_dir={out}", *lora, dry_run=True), capsys, tmp_path,
                names="it trained LoRA adapters {'rank': 8")


# ---------------------------------------------------------------------- plan, sft and rm

@pytest.mark.parametrize("args,names", [
    (["--gpu-mem-gb", "inf"], "--gpu-mem-gb must be a finite number"),
    (["--gpu-mem-gb", "nan"], "--gpu-mem-gb must be a finite number"),
    (["--gpu-mem-gb", "-8"], "--gpu-mem-gb must be a finite number"),
    (["--nodes", "0"], "nodes must be a positive integer"),
])
def test_a_bad_plan_argument_is_refused(world, capsys, args, names):
    argv = ["plan", "--config", str(world / "recipe.yaml"), "--nodes", "1", *args]
    refused(argv, capsys, world, names=names)


@pytest.mark.parametrize("stage", ["sft", "rm"])
@pytest.mark.parametrize("text,names", [
    ("model: {preset: tiny\n", "YAML syntax error"),
    ("modle: {preset: tiny}\n", "modle"),
    ("- a list\n", "must hold a mapping"),
])
def test_a_bad_stage_config_is_refused(world, capsys, stage, text, names):
    path = world / f"{stage}_bad.yaml"
    path.write_text(text)
    refused([stage, "--config", str(path)], capsys, world, names=names)
    refused([stage, "--config", str(world / "absent.yaml")], capsys, world, names="absent.yaml")


# -------------------------------------------------------------------- user reward code

def _samples(*responses: list[int]) -> list[Sample]:
    return [Sample(prompt=None, response=None, prompt_ids=[5, 6], response_ids=list(r))
            for r in responses]


@pytest.mark.parametrize("fn,names", [
    ("none_reward", "returned None (NoneType); it must return a real number"),
    ("string_reward", "returned '1.0' (str)"),
    ("nan_reward", "returned nan; return a finite number, or set nan_policy=skip"),
    ("raising_reward", "raised ZeroDivisionError"),
])
def test_a_reward_fn_that_returns_no_reward_is_named_with_the_step_and_sample(fn, names):
    reward = RewardFunction(f"tests.ppo_tasks:{fn}", allow_non_finite=False)
    try:
        with pytest.raises(RewardFnError) as failure:
            reward.score(3, _samples([7], [8, 9]))
    finally:
        reward.close()
    message = str(failure.value)
    assert f"reward_fn tests.ppo_tasks:{fn} at step 3, sample" in message and names in message
    assert "\n" not in message


def test_reward_fn_values_of_any_real_type_are_taken():
    reward = RewardFunction("tests.ppo_tasks:typed_reward", allow_non_finite=True)
    try:
        scores, metrics, _ = reward.score(1, _samples(*[[1] * n for n in range(4)]))
    finally:
        reward.close()
    assert scores.tolist() == [0.0, 1.0, 2.0, math.inf]  # int, float, 0-d tensor, inf (skip)
    assert scores.dtype == torch.float32
    assert metrics == {"reward/timeouts": 0.0, "reward/worker_restarts": 0.0}


# -------------------------------------------------------------- what a killed run leaves

def test_leftovers_of_a_killed_save_or_prune_are_removed_and_nothing_else(tmp_path):
    saved = checkpoints.of_run(str(tmp_path))
    base = saved.root
    for name in ("step_3", "step_6.tmp", "step_2.deleting", "step_1", "step_4.old", "mine"):
        os.makedirs(os.path.join(base, name))
    with open(os.path.join(base, "step_3", checkpoints.STATE), "w") as f:
        f.write("{}")
    (tmp_path / "checkpoints" / "notes.txt").write_text("mine")
    removed = saved.remove_leftovers()
    assert removed == ["step_1", "step_2.deleting", "step_4.old", "step_6.tmp"]
    assert sorted(os.listdir(base)) == ["mine", "notes.txt", "step_3"]


def test_metrics_are_cut_back_to_the_resumed_step(tmp_path):
    lines = [json.dumps({"event": "data", "train": 9})]  # not a step's: kept
    lines += [json.dumps({"step": s, "reward/mean": s / 10}) for s in (1, 2, 3, 4)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 5, "rew')
    MetricsLog(str(tmp_path), name="ppo", steps=6, resumed_step=3).close()
    assert (tmp_path / "metrics.jsonl").read_text() == "\n".join(lines[:4]) + "\n"


# ----------------------------------------------------------------------- sft: values, data

@pytest.fixture(scope="module")
def sft_world(world):
    from megarlhf.data import synthetic
    from megarlhf.data.tokenizer import train_sentencepiece

    root = world / "sft"
    root.mkdir()
    sp = train_sentencepiece(synthetic.tokenizer_corpus(), str(root / "sp.model"),
                             vocab_size=256)
    data = synthetic.write_jsonl(synthetic.sft_records(20), str(root / "sft.jsonl"))
    (root / "sft.yaml").write_text(yaml.safe_dump({
        "model": {"preset": "tiny", "overrides": {"vocab_size": 256}},
        "data": {"train": {"path": data}, "tokenizer": sp, "max_length": 48},
        "train": {"output_dir": str(root / "out"), "steps": 2, "global_batch_size": 4,
                  "micro_batch_size": 2}}))
    return root


SFT_CASES = [
    (["optim.lr=-1"], "lr > 0"),
    (["optim.lr=.nan"], "lr must be a finite number"),
    (["optim.lr=.inf"], "lr must be a finite number"),
    (["optim.adam_beta2=1.5"], "adam_beta2 must be in [0, 1)"),
    (["optim.adam_eps=0"], "adam_eps > 0"),
    (["optim.clip_grad=-1"], "clip_grad must be >= 0"),
    (["train.steps=0"], "steps"),
    (["train.global_batch_size=3"], "global_batch_size"),
    (["parallel.tensor_parallel=3"], "tensor_parallel"),
    (["data.train.path=/nonexistent/sft.jsonl"], "/nonexistent/sft.jsonl"),
    (["data.tokenizer=/nonexistent/sp.model"], "/nonexistent/sp.model"),
    (["trian.steps=3"], "trian"),
]


@pytest.mark.parametrize("overrides,names", SFT_CASES, ids=[c[0][0] for c in SFT_CASES])
def test_a_bad_sft_value_or_path_is_refused_before_spawning(sft_world, capsys, overrides,
                                                            names):
    refused(["sft", "--config", str(sft_world / "sft.yaml"), "--nproc", "2", *overrides],
            capsys, sft_world, names=names)


def test_sft_export_hf_may_not_replace_checkpoints_or_a_users_directory(sft_world, capsys):
    out = sft_world / "out"
    mine = sft_world / "mine"
    mine.mkdir(exist_ok=True)
    (mine / "notes.md").write_text("mine")
    config = ["sft", "--config", str(sft_world / "sft.yaml"), "--nproc", "2"]
    for export, names in ((out, "contains the input"),
                          (sft_world, "contains the input"),
                          (out / "checkpoints" / "hf", "is inside the input"),
                          (mine, "exists and was not written by megarlhf")):
        for dry_run in ([], ["--dry-run"]):
            refused(config + dry_run + [f"train.export_hf={export}"], capsys, sft_world,
                    names=f"train.export_hf {export} {names}")
    with pytest.raises(SystemExit) as exit_:  # beside the checkpoints is fine
        cli(config + ["--dry-run", f"train.export_hf={out}/hf"])
    assert exit_.value.code == 0, capsys.readouterr().err
