"""LoRA against full fine-tuning on a real model (SmolLM2-135M-Instruct, the arithmetic recipe
recipes/smollm2-135m-grpo-arithmetic.yaml, 2 colocated ranks, Megatron rollouts, fp32):

1. side by side in one run: the model state on a rank while training (weights, gradients,
   optimizer: the run's memory/train_state_mib) and the step time (median of steps 2-N),
   full vs LoRA rank 16 and 64 on every projection;
2. the recipe's learning curve with LoRA (rank 16, alpha 32, learning rate 10x the
   recipe's), validation accuracy on the 64 held-out questions every 5 steps; the last point
   checked independently with HF transformers' greedy answers of the exported (merged)
   actor.

3. with --bf16-gaps N only: the trainer-vs-engine logprob gap in bf16 (the engine gets the
   merged weights rounded to bf16), full vs LoRA rank 16, over N steps each.
4. with --checkpoint-sizes only: the bytes of a LoRA run's checkpoint (rank 16 and 64, one
   step of the recipe): adapter-only, as saved, against every weight, as LoRA checkpoints held
   before (the base's bytes plus the adapter-only checkpoint's: tests/test_lora.py checks that
   a full save is exactly that).

    python -m bench.bench_lora [--steps 40] [--timing-steps 4] [--append BENCHMARKS.md]
    python -m bench.bench_lora --bf16-gaps 6 [--append BENCHMARKS.md]
    python -m bench.bench_lora --checkpoint-sizes [--append BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile

from bench.bench_rlvr import RECIPE, hf_accuracy, recipe_inputs, train_and_export
from bench.report import append_entry
from megarlhf.configio import load_config
from megarlhf.metrics import read_metrics
from megarlhf.ppo import checkpoints
from megarlhf.ppo.config import PPOConfig
from megarlhf.ppo.controller import run

VARIANTS = {"full": [], "LoRA r16": ["layout.actor.lora.rank=16", "layout.actor.lora.alpha=32"],
            "LoRA r64": ["layout.actor.lora.rank=64", "layout.actor.lora.alpha=128"]}
CURVE = ["layout.actor.lora.rank=16", "layout.actor.lora.alpha=32", "actor_lr=1.0e-4"]


def timings(tmp: str, inputs: list[str], steps: int) -> list[str]:
    lines = ["| actor | model state on a rank while training (MiB) | step (s) | train phase (s) |",
             "|---|---|---|---|"]
    for name, overrides in VARIANTS.items():
        out = os.path.join(tmp, name.replace(" ", "_"))
        config = load_config(PPOConfig, RECIPE, [*inputs, *overrides, f"out_dir={out}",
                                                 f"steps={steps}", "val_every=0",
                                                 "val_prompts=null", "save_every=0"])
        history = run(config)[1:]
        lines.append(f"| {name} | {max(m['memory/train_state_mib'] for m in history):.0f} | "
                     f"{statistics.median(m['time/step'] for m in history):.2f} | "
                     f"{statistics.median(m['time/train'] for m in history):.2f} |")
    return lines


def bf16_gaps(tmp: str, inputs: list[str], steps: int) -> list[str]:
    lines = ["| actor (bf16) | gap max, steps 2-N (max) | gap mean (max) | reward, last step |",
             "|---|---|---|---|"]
    for name, overrides in (("full", []), ("LoRA r16", CURVE)):
        out = os.path.join(tmp, "bf16_" + name.replace(" ", "_"))
        config = load_config(PPOConfig, RECIPE, [*inputs, *overrides, f"out_dir={out}",
                                                 f"steps={steps}", "val_every=0",
                                                 "val_prompts=null", "save_every=0",
                                                 "dtype=bf16", "rollout_correction=tis"])
        history = run(config)[1:]
        lines.append(f"| {name} | {max(m['rollout/logprob_gap_max'] for m in history):.3g} | "
                     f"{max(m['rollout/logprob_gap_mean'] for m in history):.3g} | "
                     f"{history[-1]['reward/mean']:.3f} |")
    return lines


def checkpoint_sizes(tmp: str, inputs: list[str]) -> list[str]:
    base = int(subprocess.run(["du", "-sb", inputs[0].split("=", 1)[1]], capture_output=True,
                              text=True, check=True).stdout.split()[0])
    lines = ["| actor | checkpoint with every weight (before), MiB | adapter-only (now), MiB | "
             "ratio |", "|---|---|---|---|"]
    for name, overrides in VARIANTS.items():
        if not overrides:
            continue
        out = os.path.join(tmp, "ckpt_" + name.replace(" ", "_"))
        run(load_config(PPOConfig, RECIPE, [*inputs, *overrides, f"out_dir={out}", "steps=1",
                                            "val_every=0", "val_prompts=null"]))
        saved = os.path.join(checkpoints.of_run(out).latest(), "actor")
        now = int(subprocess.run(["du", "-sb", saved], capture_output=True, text=True,
                                 check=True).stdout.split()[0])
        mib = 1 << 20
        lines.append(f"| {name} | {(base + now) / mib:.0f} | {now / mib:.1f} | "
                     f"{(base + now) / now:.1f}x |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--timing-steps", type=int, default=4)
    parser.add_argument("--append", default=None, help="append the result to this file")
    parser.add_argument("--bf16-gaps", type=int, default=0, metavar="N",
                        help="only measure the bf16 logprob gaps, over N steps per variant")
    parser.add_argument("--checkpoint-sizes", action="store_true",
                        help="only measure a LoRA run's checkpoint bytes")
    args = parser.parse_args()
    if args.checkpoint_sizes:
        with tempfile.TemporaryDirectory() as tmp:
            _, _, inputs = recipe_inputs(tmp)
            body = "\n".join(checkpoint_sizes(tmp, inputs)) + (
                "\n\nThe actor's checkpoint after one step of the arithmetic recipe (fp32, "
                "Adam), `du -sb`: adapters and their optimizer state with the base's path "
                "and fingerprint, against the same plus the base's weights.")
        print(body)
        if args.append:
            append_entry(args.append, "LoRA checkpoint size, adapter-only vs every weight "
                         "(SmolLM2-135M-Instruct)", "python -m bench.bench_lora "
                         "--checkpoint-sizes", body)
        return
    if args.bf16_gaps:
        with tempfile.TemporaryDirectory() as tmp:
            _, _, inputs = recipe_inputs(tmp)
            body = "\n".join(bf16_gaps(tmp, inputs, args.bf16_gaps)) + (
                f"\n\nThe arithmetic recipe in bf16 (trainer and Megatron engine), "
                f"{args.bf16_gaps} steps per variant, LoRA at lr 1e-4; the gap guard's "
                f"default limits apply.")
        print(body)
        if args.append:
            append_entry(args.append, "LoRA's merged weight sync in bf16 (SmolLM2-135M-"
                         "Instruct)", f"python -m bench.bench_lora --bf16-gaps "
                         f"{args.bf16_gaps}", body)
        return
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir, val, inputs = recipe_inputs(tmp)
        table = timings(tmp, inputs, args.timing_steps)
        config, history, exported = train_and_export(tmp, RECIPE, [*inputs, *CURVE],
                                                     args.steps)
        curve = [m for m in read_metrics(config.out_dir) if "val/reward_mean" in m]
        after = hf_accuracy(exported, val, config.max_new_tokens)
    points = ", ".join(f"{m['step']}: {m['val/reward_mean']:.3f}" for m in curve)
    body = "\n".join(table) + (
        f"\n\nModel state is the largest memory/train_state_mib of steps 2-{args.timing_steps}"
        f" (rank 0: the actor's weights, gradients and Adam states with fp32 master weights, "
        f"plus the reference copy without LoRA); times are medians of those steps.\n\n"
        f"LoRA curve (rank 16, alpha 32, every projection, lr {config.actor_lr:g}: 10x the "
        f"recipe's full fine-tuning rate), greedy validation accuracy on 64 held-out "
        f"questions by step: {points}. The exported actor (adapters merged) answers "
        f"{after:.3f} of them with HF transformers' greedy generation (same checker).")
    print(body)
    if args.append:
        append_entry(args.append, "LoRA vs full fine-tuning on a real model (SmolLM2-135M-"
                     "Instruct, arithmetic GRPO)",
                     f"python -m bench.bench_lora --steps {args.steps} --timing-steps "
                     f"{args.timing_steps}", body)


if __name__ == "__main__":
    main()
