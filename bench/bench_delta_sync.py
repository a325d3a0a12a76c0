"""Delta vs full weight sync on the real-model recipe (recipes/smollm2-135m-grpo-arithmetic.yaml:
SmolLM2-135M-Instruct, GRPO, 8 prompts x 4 samples of <= 12 tokens), disaggregated: one
training rank and one rollout rank (Megatron engine) on this machine's two cores.

The same steps twice per dtype, side by side: sync_mode=full and sync_mode=delta. Reported per
run: what a sync sends (MiB; a full sync's size beside it), the share of the weights' elements
whose bits changed in a step, how many of the bridge's buckets went as deltas, and the
controller's seconds per sync (time/sync, median of the steps after the first). The two runs of
a dtype train on the same samples (the engine gets the same bits), so their rewards agree.

    python -m bench.bench_delta_sync [--steps 4] [--dtypes bf16 fp32] [--append BENCHMARKS.md]
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


def one_run(tmp: str, inputs: list[str], dtype: str, mode: str, steps: int) -> dict:
    out_dir = os.path.join(tmp, f"{dtype}-{mode}")
    run(load_config(PPOConfig, RECIPE, [
        *inputs, f"out_dir={out_dir}", f"steps={steps}", "val_every=0", "val_prompts=null",
        "save_every=0", f"dtype={dtype}", "placement=disaggregated", "nproc=1",
        "rollout_nproc=1", f"sync_mode={mode}"]))
    later = read_steps(out_dir)[1:]  # the first step includes one-off work
    out = {"sync_s": statistics.median(m["time/sync"] for m in later),
           "step_s": statistics.median(m["time/step"] for m in later),
           "reward": [round(m["reward/mean"], 4) for m in read_steps(out_dir)]}
    if mode == "delta":
        out.update(sent=statistics.median(m["sync/sent_mib"] for m in later),
                   full=later[0]["sync/full_mib"],
                   changed=statistics.median(m["sync/changed_fraction"] for m in later),
                   deltas=statistics.median(m["sync/delta_buckets"] for m in later),
                   buckets=later[0]["sync/buckets"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"])
    parser.add_argument("--append", default=None, help="append the results to this file")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        _, _, inputs = recipe_inputs(tmp)
        for dtype in args.dtypes:
            full = one_run(tmp, inputs, dtype, "full", args.steps)
            delta = one_run(tmp, inputs, dtype, "delta", args.steps)
            assert full["reward"] == delta["reward"], (full["reward"], delta["reward"])
            rows += [f"| {dtype} | full | {delta['full']:.1f} | - | - | {full['sync_s']:.2f} | "
                     f"{full['step_s']:.2f} |",
                     f"| {dtype} | delta | {delta['sent']:.1f} | {delta['changed']:.1%} | "
                     f"{delta['deltas']:.0f} of {delta['buckets']:.0f} | "
                     f"{delta['sync_s']:.2f} | {delta['step_s']:.2f} |"]
    body = "\n".join([
        "| dtype | sync_mode | sent per sync (MiB) | elements changed per step | delta "
        "buckets | time/sync (s) | step (s) |",
        "|---|---|---|---|---|---|---|", *rows, "",
        f"Medians of steps 2-{args.steps}; each dtype's two runs logged the same rewards step "
        f"by step (the engine got the same bits)."])
    print(body)
    if args.append:
        append_entry(args.append, "Delta vs full weight sync (SmolLM2-135M, arithmetic GRPO "
                     "recipe, disaggregated 1 + 1 ranks)",
                     f"python -m bench.bench_delta_sync --steps {args.steps} --dtypes "
                     f"{' '.join(args.dtypes)}", body)


if __name__ == "__main__":
    main()
