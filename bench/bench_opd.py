"""On-policy distillation vs GRPO on a real model, from the same start: validation accuracy
per step of recipes/smollm2-135m-opd-arithmetic.yaml (SmolLM2-135M-Instruct distilled from a
teacher) and of recipes/smollm2-135m-grpo-arithmetic.yaml (GRPO with the `math` reward), and
the steps each needs to reach 90% of the teacher's accuracy. The teacher is the GRPO run's own
last actor, so the GRPO curve is the run that made it; both validate greedy answers to the
same 64 held-out questions every `--every` steps.

    python -m bench.bench_opd [--grpo-steps 24] [--opd-steps 16] [--every 2]
                              [--append BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import os
import tempfile

from bench.bench_rlvr import recipe_inputs
from bench.report import append_entry
from megarlhf.configio import load_config
from megarlhf.metrics import read_metrics
from megarlhf.ppo import checkpoints
from megarlhf.ppo.config import PPOConfig
from megarlhf.ppo.controller import run

RECIPES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes")
GRPO = os.path.join(RECIPES, "smollm2-135m-grpo-arithmetic.yaml")
OPD = os.path.join(RECIPES, "smollm2-135m-opd-arithmetic.yaml")


def curve_of(recipe: str, overrides: list[str]) -> tuple[PPOConfig, dict[int, float], float]:
    """Run `recipe` with `overrides`; (its config, validation accuracy by step, seconds of
    steps and validation)."""
    config = load_config(PPOConfig, recipe, overrides)
    history = run(config)
    val = [m for m in read_metrics(config.out_dir) if "val/reward_mean" in m]
    wall = sum(m["time/wall"] for m in history) + sum(m.get("time/validation", 0.0)
                                                      for m in val if m["step"] == 0)
    return config, {m["step"]: m["val/reward_mean"] for m in val}, wall


def steps_to(curve: dict[int, float], target: float) -> int | None:
    """The first validated step at or above `target` (None: never within the run)."""
    return next((step for step, acc in sorted(curve.items()) if acc >= target), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--grpo-steps", type=int, default=24)
    parser.add_argument("--opd-steps", type=int, default=16)
    parser.add_argument("--every", type=int, default=2, help="validate every N steps")
    parser.add_argument("--append", default=None, help="append the result to this file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        _, _, inputs = recipe_inputs(tmp)
        common = [*inputs, f"val_every={args.every}", "save_every=0"]
        grpo_config, grpo, grpo_wall = curve_of(
            GRPO, [*common, f"steps={args.grpo_steps}", f"out_dir={tmp}/grpo"])
        teacher = os.path.join(checkpoints.of_run(grpo_config.out_dir).latest(), "actor")
        opd_config, opd, opd_wall = curve_of(
            OPD, [*common, f"steps={args.opd_steps}", f"out_dir={tmp}/opd",
                  f"teacher={teacher}"])
    teacher_acc = grpo[args.grpo_steps]
    target = 0.9 * teacher_acc
    lines = ["| step | OPD accuracy (64) | GRPO accuracy (64) |", "|---|---|---|"]
    for step in sorted(set(grpo) | set(opd)):
        cells = [f"{c[step]:.3f}" if step in c else "" for c in (opd, grpo)]
        lines.append(f"| {step} | {cells[0]} | {cells[1]} |")

    def reached(curve: dict[int, float], steps: int) -> str:
        step = steps_to(curve, target)
        return f"step {step}" if step is not None else f"not within {steps} steps"

    body = "\n".join(lines) + (
        f"\n\nTeacher: the GRPO run's actor after step {args.grpo_steps} (accuracy "
        f"{teacher_acc:.3f}); 90% of it is {target:.3f}. OPD reaches it at "
        f"{reached(opd, args.opd_steps)}, GRPO at {reached(grpo, args.grpo_steps)} (validation "
        f"every {args.every} steps; one question is 1.6 points). Both from SmolLM2-135M-Instruct "
        f"(accuracy {grpo[0]:.3f}), 8 prompts x 4 samples x <= {grpo_config.max_new_tokens} new "
        f"tokens, lr {grpo_config.actor_lr:g}, 2 colocated ranks, Megatron rollouts, fp32; OPD "
        f"trains on distill_coef {opd_config.options.distill_coef:g} x (teacher - student "
        f"logprob) per token, GRPO on the math reward. Minutes of steps and validation: OPD "
        f"{opd_wall / 60:.1f} ({args.opd_steps} steps), GRPO {grpo_wall / 60:.1f} "
        f"({args.grpo_steps} steps).")
    print(body)
    if args.append:
        append_entry(args.append, "On-policy distillation vs GRPO on a real model "
                     "(SmolLM2-135M-Instruct, one-digit arithmetic)",
                     f"python -m bench.bench_opd --grpo-steps {args.grpo_steps} --opd-steps "
                     f"{args.opd_steps} --every {args.every}", body)


if __name__ == "__main__":
    main()
