"""GRPO with a verifiable reward on a real model: the learning curve of
recipes/smollm2-135m-grpo-arithmetic.yaml (SmolLM2-135M-Instruct, the real-model tier's, from
tests/real_model.py; one-digit arithmetic, the built-in `math` reward), as validation accuracy
on 64 held-out questions before training and every `val_every` steps, per operation. The
first and last points are checked independently: HF transformers' greedy answers of the
source model and of the trained actor exported to HF, scored by the same checker.

    python -m bench.bench_rlvr [--steps 60] [--append BENCHMARKS.md] [--png PATH]
"""

from __future__ import annotations

import argparse
import os
import tempfile

from bench.report import append_entry
from megarlhf.configio import load_config
from megarlhf.convert.hf_to_mcore import hf_to_mcore
from megarlhf.convert.mcore_to_hf import mcore_to_hf
from megarlhf.data import synthetic
from megarlhf.metrics import read_metrics
from megarlhf.parallel.mesh import ParallelConfig
from megarlhf.ppo import checkpoints
from megarlhf.ppo.config import PPOConfig
from megarlhf.ppo.controller import run
from tests import real_model

RECIPE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes",
                      "smollm2-135m-grpo-arithmetic.yaml")
SOURCES = tuple(synthetic.ARITHMETIC)


def _plot(curve: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [m["step"] for m in curve]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(steps, [m["val/reward_mean"] for m in curve], marker="o", label="all (64)")
    for source in SOURCES:
        ax.plot(steps, [m[f"val/{source}/reward_mean"] for m in curve], linestyle="--",
                alpha=0.7, label=source)
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("greedy validation accuracy")
    ax.set_title("SmolLM2-135M-Instruct, one-digit arithmetic, math reward")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def recipe_inputs(tmp: str, ask: str = synthetic.ANSWER_FORMAT
                  ) -> tuple[str, list[dict], list[str]]:
    """The recipe's inputs made in `tmp`: SmolLM2 converted, the arithmetic train and held-out
    rows written, each question asking `ask` of the answer (the recipe's: the number alone).
    Returns (HF dir, held-out rows, the recipe overrides naming them)."""
    hf_dir = real_model.smollm2_dir()
    actor = os.path.join(tmp, "actor")
    hf_to_mcore(hf_dir, actor, parallel=ParallelConfig())
    train, val = ([{**r, "prompt": r["prompt"].removesuffix(synthetic.ANSWER_FORMAT) + ask}
                   for r in rows] for rows in synthetic.arithmetic_records(held_out=64))
    return hf_dir, val, [
        f"actor={actor}",
        f"prompts={synthetic.write_jsonl(train, os.path.join(tmp, 'train.jsonl'))}",
        f"val_prompts={synthetic.write_jsonl(val, os.path.join(tmp, 'val.jsonl'))}"]


def train_and_export(tmp: str, recipe: str, inputs: list[str], steps: int | None
                     ) -> tuple[PPOConfig, list[dict], str]:
    """Run `recipe` with `inputs` (recipe_inputs' overrides) in `tmp`, for `steps` (None: the
    recipe's); (its config, its step metrics, its last actor exported to HF)."""
    overrides = [*inputs, f"out_dir={os.path.join(tmp, 'run')}",
                 "save_every=0"]  # the last step is saved (and exported below)
    if steps:
        overrides.append(f"steps={steps}")
    config = load_config(PPOConfig, recipe, overrides)
    history = run(config)
    exported = os.path.join(tmp, "exported")
    mcore_to_hf(os.path.join(checkpoints.of_run(config.out_dir).latest(), "actor"), exported)
    return config, history, exported


def hf_accuracy(hf_dir: str, val: list[dict], max_new_tokens: int,
                dtype: str = "float32") -> float:
    """Greedy accuracy of the HF model in `hf_dir` on `val` (chat template, math checker),
    its weights cast to torch's `dtype`."""
    import torch
    import transformers

    from megarlhf.rewards import math_reward

    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir,
                                                              dtype=getattr(torch, dtype))
    tok.padding_side = "left"
    texts = [tok.apply_chat_template([{"role": "user", "content": r["prompt"]}],
                                     add_generation_prompt=True, tokenize=False) for r in val]
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False)
    answers = tok.batch_decode(out[:, enc.input_ids.shape[1]:], skip_special_tokens=True)
    scores = math_reward(answers, [r["ground_truth"] for r in val])["scores"]
    return sum(scores) / len(scores)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="default: the recipe's")
    parser.add_argument("--append", default=None, help="append the result to this file")
    parser.add_argument("--png", default="bench/results/rlvr_curve.png")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir, val, inputs = recipe_inputs(tmp)
        config, history, exported = train_and_export(tmp, RECIPE, inputs, args.steps)
        curve = [m for m in read_metrics(config.out_dir) if "val/reward_mean" in m]
        check = {"before": hf_accuracy(hf_dir, val, config.max_new_tokens),
                 "after": hf_accuracy(exported, val, config.max_new_tokens)}
    first, last = curve[0], curve[-1]
    lines = ["| step | accuracy (64) | " + " | ".join(SOURCES) + " | train reward | answered |",
             "|---" * (4 + len(SOURCES)) + "|"]
    by_step = {m["step"]: m for m in history}
    for m in curve:
        train_m = by_step.get(m["step"], {})
        lines.append(f"| {m['step']} | {m['val/reward_mean']:.3f} | " +
                     " | ".join(f"{m[f'val/{s}/reward_mean']:.3f}" for s in SOURCES) +
                     f" | {train_m.get('reward/mean', float('nan')):.3f} | "
                     f"{train_m.get('reward/answered', float('nan')):.3f} |")
    wall = sum(m["time/wall"] for m in history) + sum(m.get("time/validation", 0.0)
                                                      for m in curve if m["step"] == 0)
    gain = 100 * (last["val/reward_mean"] - first["val/reward_mean"])
    body = "\n".join(lines) + (
        f"\n\nValidation accuracy {first['val/reward_mean']:.3f} -> {last['val/reward_mean']:.3f} "
        f"({gain:+.1f} points) after {config.steps} steps; {wall / 60:.1f} min of steps and "
        f"validation. Recipe: {os.path.relpath(RECIPE)} (GRPO, 8 prompts x 4 samples x <= "
        f"{config.max_new_tokens} new tokens, lr {config.actor_lr:g}, 2 colocated ranks, "
        f"Megatron rollouts, fp32). 'train reward' and 'answered' (an answer found at all) are "
        f"the training batch's at that step. Curve: {args.png}. Checked independently with HF "
        f"transformers' greedy generation (same prompts, {config.max_new_tokens} tokens, same checker): source model "
        f"{check['before']:.3f}, trained actor exported to HF {check['after']:.3f}.")
    os.makedirs(os.path.dirname(args.png) or ".", exist_ok=True)
    _plot(curve, args.png)
    print(body)
    if args.append:
        append_entry(args.append, "GRPO with a verifiable reward on a real model "
                     "(SmolLM2-135M-Instruct, one-digit arithmetic)",
                     "python -m bench.bench_rlvr" + (f" --steps {args.steps}" if args.steps
                                                     else ""), body)


if __name__ == "__main__":
    main()
