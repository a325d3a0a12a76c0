"""Where a GRPO step's time goes: the arithmetic recipe (recipes/smollm2-135m-grpo-arithmetic.yaml:
SmolLM2-135M-Instruct, 8 prompts x 4 samples x <= 12 new tokens, Megatron rollouts), fp32 and
bf16, on 1 and 2 colocated ranks, its last steps profiled (profile: true).

Per variant: the step's wall time (median of the unprofiled steps 2-N-1), each phase's
seconds (rank 0's profile), and the phase's operator time by category (megarlhf/profiling.py)
with the time outside operators.

    python -m bench.bench_step_profile [--steps 4] [--variants fp32-2,bf16-2,...] [--append BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

from bench.bench_rlvr import RECIPE, recipe_inputs
from bench.report import append_entry
from megarlhf.configio import load_config
from megarlhf.metrics import read_metrics
from megarlhf.ppo.config import PPOConfig
from megarlhf.ppo.controller import run

VARIANTS = {"fp32-2": ["dtype=fp32", "nproc=2"], "bf16-2": ["dtype=bf16", "nproc=2"],
            "fp32-1": ["dtype=fp32", "nproc=1"], "bf16-1": ["dtype=bf16", "nproc=1"]}
SHOWN = ("matmul", "attention", "softmax/logprob", "optimizer", "communication",
         "data movement", "other")


def profile_variant(tmp: str, inputs: list[str], name: str, steps: int) -> dict:
    out = os.path.join(tmp, name)
    config = load_config(PPOConfig, RECIPE, [*inputs, *VARIANTS[name], f"out_dir={out}",
                                             f"steps={steps}", "val_every=0",
                                             "val_prompts=null", "save_every=0",
                                             "profile=true", f"profile_steps=[{steps}]"])
    history = run(config)
    unprofiled = history[1:-1] or history[:1]
    (event,) = [r for r in read_metrics(out) if r.get("event") == "profile"]
    return {"step": statistics.median(m["time/step"] for m in unprofiled),
            "phases": {p: statistics.median(m[f"time/worker/{p}"] for m in unprofiled)
                       for p in ("rollout", "experience", "train", "sync")},
            "profile": event["phases"]}


def table(results: dict[str, dict]) -> list[str]:
    lines = ["| variant | step (s) | phase | phase (s) | profiled (s) | outside operators | "
             + " | ".join(SHOWN) + " |", "|---" * (5 + len(SHOWN)) + "|"]
    for name, r in results.items():
        for phase, t in r["profile"].items():
            cells = [f"{t['categories'].get(c, 0.0):.2f}" for c in SHOWN]
            lines.append(f"| {name} | {r['step']:.2f} | {phase} | {r['phases'][phase]:.2f} | "
                         f"{t['wall_s']:.2f} | {t['host_s']:.2f} | " + " | ".join(cells) + " |")
    return lines


def top_operators(results: dict[str, dict], count: int = 8) -> list[str]:
    lines = []
    for name, r in results.items():
        for phase in ("experience", "train"):
            ops = ", ".join(f"{row['op']} {row['self_s']:.2f}"
                            for row in r["profile"][phase]["top"][:count])
            lines.append(f"- {name} {phase}: {ops}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--append", default=None, help="append the result to this file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        _, _, inputs = recipe_inputs(tmp)
        results = {name: profile_variant(tmp, inputs, name, args.steps)
                   for name in args.variants.split(",")}
    body = "\n".join(table(results)) + (
        f"\n\nThe arithmetic recipe, {args.steps} steps per variant: step and phase seconds "
        f"are medians of steps 2-{args.steps - 1} (unprofiled); the profiled step "
        f"{args.steps}'s phases (rank 0) split into operator self time by category and the "
        f"time outside operators (Python, the host's bookkeeping).\n\nTop operators by self "
        f"time (s), profiled step:\n" + "\n".join(top_operators(results)))
    print(body)
    if args.append:
        append_entry(args.append, "Where a GRPO step's time goes (SmolLM2-135M-Instruct, "
                     "arithmetic recipe, profile: true)",
                     f"python -m bench.bench_step_profile --steps {args.steps} --variants "
                     f"{args.variants}", body)


if __name__ == "__main__":
    main()
