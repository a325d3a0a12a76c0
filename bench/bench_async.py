"""One-step-off-policy rollouts (async_rollout) against synchronous ones in the disaggregated
placement: step rate and the reward curve of each over the same steps, in one run.

Setup: bench_ppo's tiny actor and reference (4 layers, hidden 64, vocabulary 300, seed-0
weights), GRPO on the low-token task (tests/ppo_tasks.py: the fraction of 'low' tokens in a
response) with TIS, 8 prompts x 4 samples of --new-tokens tokens per step, 2 epochs of
--mini-batches optimizer steps, Megatron rollouts on their own rank, actor and reference
groups of one rank each. Synchronous, the rollout rank
waits while the others learn and the other way round; asynchronous, step n+1's rollout runs
while step n learns, sampled with weights one update older.

    python -m bench.bench_async [--steps 15] [--new-tokens 48] [--mini-batches 4]
                                [--append BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from bench.bench_ppo import write_inputs
from bench.report import append_entry

PHASES = ("rollout", "reward", "ahead/rollout", "ahead/reward", "experience", "train",
          "wait_rollout_ahead", "sync")
"""Where a step's time goes; a rollout drawn ahead (ahead/...) ran during the step before."""


def _run(config) -> dict:
    from megarlhf.ppo.controller import run

    start = time.perf_counter()
    history = run(config)
    total = time.perf_counter() - start
    phases = {p: statistics.median(m.get(f"time/{p}", 0.0) for m in history[1:])
              for p in PHASES}
    return {"step": statistics.median(m["time/wall"] for m in history[1:]), "phases": phases,
            "steps_total": sum(m["time/wall"] for m in history[1:]), "total": total,
            "reward": [m["reward/mean"] for m in history],
            "lag": [m["rollout/policy_lag"] for m in history]}


def measure(steps: int, new_tokens: int, mini_batches: int) -> tuple[str, dict]:
    from megarlhf.ppo.config import PPOConfig

    load = [os.getloadavg()[0]]
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        actor, _, prompts = write_inputs(tmp)
        for mode in ("sync", "async"):
            config = PPOConfig(
                actor=actor, prompts=prompts, out_dir=os.path.join(tmp, mode),
                reward_fn="tests.ppo_tasks:low_token_fraction", algorithm="grpo",
                rollout_correction="tis", placement="disaggregated",
                async_rollout=mode == "async", steps=steps, prompts_per_step=8,
                samples_per_prompt=4, max_new_tokens=new_tokens, actor_lr=3e-3,
                mini_batches=mini_batches, ppo_epochs=2)
            out[mode] = _run(config)
            load.append(os.getloadavg()[0])
    sync, async_ = out["sync"], out["async"]
    lines = ["| | synchronous | one-step-off (async_rollout) | ratio |", "|---|---|---|---|",
             f"| step wall time (s, median of steps 2-{steps}) | {sync['step']:.2f} | "
             f"{async_['step']:.2f} | {sync['step'] / async_['step']:.2f}x |",
             f"| steps 2-{steps}, sum of step wall times (s) | {sync['steps_total']:.1f} | "
             f"{async_['steps_total']:.1f} | {sync['steps_total'] / async_['steps_total']:.2f}x |",
             *[f"| {p} (s, median) | {sync['phases'][p]:.3f} | {async_['phases'][p]:.3f} | |"
               for p in PHASES],
             "", "| step | " + " | ".join(str(i) for i in range(1, steps + 1)) + " |",
             "|---" * (steps + 1) + "|",
             "| reward, synchronous | " + " | ".join(f"{r:.3f}" for r in sync["reward"]) + " |",
             "| reward, async | " + " | ".join(f"{r:.3f}" for r in async_["reward"]) + " |"]
    note = (f"1-minute load average during the run: {min(load):.1f} to {max(load):.1f}; "
            f"async policy lag per step: {[int(x) for x in async_['lag']]}.")
    table = "\n".join(lines) + "\n\n" + note
    print(table)
    return table, out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--mini-batches", type=int, default=4)
    parser.add_argument("--append", help="append the results to this markdown file")
    args = parser.parse_args()
    table, _ = measure(args.steps, args.new_tokens, args.mini_batches)
    if args.append:
        append_entry(args.append, "One-step-off-policy rollouts vs synchronous, disaggregated "
                     "GRPO (tiny model): step rate and reward curves",
                     f"python -m bench.bench_async --steps {args.steps} "
                     f"--new-tokens {args.new_tokens} --mini-batches {args.mini_batches}",
                     table)


if __name__ == "__main__":
    main()
