"""What a generative judge costs per GRPO step, beside a rule reward, on the real-model
recipe (recipes/smollm2-135m-grpo-arithmetic.yaml: SmolLM2-135M-Instruct, 2 colocated local
ranks, Megatron rollouts, 8 prompts x 4 samples of <= 12 tokens).

Two runs of the same steps, side by side: the recipe's `math` rule alone, and the rule plus
a yes/no judge (SmolLM2-135M-Instruct itself, on the rollout ranks' Megatron engines) at
weight 0, so both runs train on the same rewards and sample the same tokens: the difference in
step time is the judge's. Also reported: the judge's own seconds per step
(`time/worker/judge`), its mean P(Yes), and how often its verdict (P(Yes) > 0.5) agrees with
the rule's over every sample of the run (samples.jsonl).

    python -m bench.bench_judge [--steps 4] [--append BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile

from bench.bench_rlvr import RECIPE, recipe_inputs
from bench.report import append_entry
from megarlhf.configio import load_config
from megarlhf.metrics import read_steps
from megarlhf.ppo.config import PPOConfig
from megarlhf.ppo.controller import run
from tests import real_model

TEMPLATE = ("Question: {prompt}\nProposed answer: {response}\nThe correct answer is "
            "{ground_truth}. Is the proposed answer correct? Answer Yes or No.")
ROWS = 32  # 8 prompts x 4 samples: every sample of a step is logged


def one_run(tmp: str, inputs: list[str], name: str, steps: int, judged: bool) -> dict:
    out_dir = os.path.join(tmp, name)
    overrides = [*inputs, f"out_dir={out_dir}", f"steps={steps}", "val_every=0",
                 "val_prompts=null", "save_every=0", f"log_samples={ROWS}"]
    if judged:
        template = os.path.join(tmp, "judge.txt")
        with open(template, "w") as f:
            f.write(TEMPLATE)
        overrides += ["reward_fn=null",
                      f"reward_judge={{model: {real_model.smollm2_dir()}, template: {template}, "
                      f"max_new_tokens: 1}}",
                      "rewards=[{name: correct, kind: math}, "
                      "{name: judge, kind: judge, weight: 0}]"]
    run(load_config(PPOConfig, RECIPE, overrides))
    history = read_steps(out_dir)
    later = history[1:]  # the first step includes one-off work
    out = {"step_s": statistics.median(m["time/step"] for m in later),
           "reward": statistics.mean(m["reward/mean"] for m in history)}
    if judged:
        with open(os.path.join(out_dir, "samples.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        # The logged reward is the rule's (the judge weighs 0): 1.0 when correct.
        agree = [(r["reward"] == 1.0) == (r["judge_score"] > 0.5) for r in rows]
        out["rule_correct"] = sum(r["reward"] == 1.0 for r in rows) / len(rows)
        out["judge_yes"] = sum(r["judge_score"] > 0.5 for r in rows) / len(rows)
        out.update(judge_s=statistics.median(m["time/worker/judge"] for m in later),
                   judge_score=statistics.mean(m["reward/judge_score"] for m in history),
                   failures=sum(m["reward/judge_parse_failures"] for m in history),
                   agreement=sum(agree) / len(agree), samples=len(rows))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--append", default=None, help="append the results to this file")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        _, _, inputs = recipe_inputs(tmp)
        rule = one_run(tmp, inputs, "rule", args.steps, judged=False)
        judged = one_run(tmp, inputs, "judged", args.steps, judged=True)
    body = "\n".join([
        "| run | step (s, median of steps 2-N) | judge (s/step) | mean reward (rule) |",
        "|---|---|---|---|",
        f"| math rule | {rule['step_s']:.2f} | - | {rule['reward']:.3f} |",
        f"| math rule + yes/no judge (weight 0) | {judged['step_s']:.2f} | "
        f"{judged['judge_s']:.2f} | {judged['reward']:.3f} |",
        "",
        f"The judge adds {judged['step_s'] - rule['step_s']:.2f} s per step "
        f"({judged['step_s'] / rule['step_s']:.2f}x the rule-only step) for 32 judge prompts "
        f"a step, one new token each. Its mean P(Yes) {judged['judge_score']:.3f}; "
        f"its verdict (P(Yes) > 0.5) agrees with the math rule on "
        f"{judged['agreement']:.1%} of {judged['samples']} samples (the rule marks "
        f"{judged['rule_correct']:.1%} correct, the judge says yes to "
        f"{judged['judge_yes']:.1%}: a judge that always said no would agree on "
        f"{1 - judged['rule_correct']:.1%}); "
        f"{judged['failures']:.0f} first tokens were neither Yes nor No. "
        f"{args.steps} steps each, val_every=0."])
    print(body)
    if args.append:
        append_entry(args.append, "A generative judge's cost per step (SmolLM2-135M judging "
                     "SmolLM2-135M, arithmetic GRPO recipe)",
                     f"python -m bench.bench_judge --steps {args.steps}", body)


if __name__ == "__main__":
    main()
