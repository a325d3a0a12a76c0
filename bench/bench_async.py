"""Synchronous, one-step-off (rollout_mode=one_step_off) and fully asynchronous
(rollout_mode=fully_async) rollouts in the disaggregated placement: step rate, policy lag
and the reward curve of each over the same steps, in one run.

Setup: bench_ppo's tiny actor and reference (4 layers, hidden 64, vocabulary 300, seed-0
weights), GRPO on the low-token task (tests/ppo_tasks.py: the fraction of 'low' tokens in a
response) with TIS, 8 prompts x 4 samples of up to --new-tokens tokens per step, 2 epochs of
--mini-batches optimizer steps, Megatron rollouts on their own rank, actor and reference
groups of one rank each. Synchronous, the rollout rank waits while the others learn and the
other way round; one-step-off, step n+1's rollout runs while step n learns; fully
asynchronous, the rollout rank generates without waiting (max_staleness 1, 16 tokens per
call). With --stop-ids K, the first K token ids end a sample: lengths then spread out to
--new-tokens (a long tail), which is where the synchronous modes wait for the slowest sample.
With --episodes, the multi-turn tests' setup instead: a toy chat Llama (2 layers, hidden 128,
the ChatML test tokenizer) in 3-turn episodes of up to 16 tokens a turn (tests/env_fns.py's
LowIds: the share of early letters in each turn as its reward). With --reward-latency S
(single-turn), the same task is scored by a reward service on 127.0.0.1 (tests/
reward_server.py) that answers each request after S seconds, as a remote judge would: the
fully asynchronous mode scores finished groups while the engine generates the others.

    python -m bench.bench_async [--steps 15] [--new-tokens 48] [--mini-batches 4]
                                [--stop-ids 0] [--episodes] [--reward-latency 0]
                                [--append BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import contextlib
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
            "length": statistics.mean(m["response_length"] for m in history),
            "dropped": sum(m.get("rollout/stale_dropped", 0.0) for m in history),
            "lag": [m["rollout/policy_lag"] for m in history],
            "token_lag": [m.get("rollout/policy_lag_mean", m["rollout/policy_lag"])
                          for m in history]}


MODES = {"sync": "synchronous", "one_step_off": "one-step-off", "fully_async": "fully async"}


def _episode_inputs(tmp: str) -> dict:
    """The multi-turn tests' toy chat model and questions, as recipe fields."""
    import json

    from megarlhf.convert.hf_to_mcore import hf_to_mcore
    from megarlhf.parallel.mesh import ParallelConfig
    from tests import hf_models
    from tests.test_multiturn import QUESTIONS

    hf_dir = hf_models.save_chat_llama(os.path.join(tmp, "hf"))
    actor = os.path.join(tmp, "actor")
    hf_to_mcore(hf_dir, actor, parallel=ParallelConfig())
    prompts = os.path.join(tmp, "questions.jsonl")
    with open(prompts, "w") as f:
        f.writelines(json.dumps({"prompt": q}) + "\n" for q in QUESTIONS * 4)
    return dict(actor=actor, prompts=prompts, environment="tests.env_fns:LowIds",
                env_args={"turns": 3}, max_turns=3, max_turn_tokens=16, max_new_tokens=96)


def measure(steps: int, new_tokens: int, mini_batches: int, stop_ids: int,
            episodes: bool = False, reward_latency: float = 0.0) -> tuple[str, dict]:
    from megarlhf.ppo.config import PPOConfig
    from tests.reward_server import RewardServer

    load = [os.getloadavg()[0]]
    out = {}
    server = None
    with tempfile.TemporaryDirectory() as tmp, contextlib.ExitStack() as stack:
        if episodes:
            task = _episode_inputs(tmp)
        else:
            actor, _, prompts = write_inputs(tmp)
            task = dict(actor=actor, prompts=prompts,
                        reward_fn="tests.ppo_tasks:low_token_fraction",
                        stop_token_ids=tuple(range(stop_ids)), max_new_tokens=new_tokens)
            if reward_latency:
                server = RewardServer()
                stack.callback(server.close)
                server.delay = reward_latency
                task.update(reward_fn=None, reward_url=server.url)
        for mode in MODES:
            config = PPOConfig(
                out_dir=os.path.join(tmp, mode), algorithm="grpo",
                rollout_correction="tis", placement="disaggregated", rollout_mode=mode,
                max_staleness=1, partial_rollout_tokens=16, steps=steps, prompts_per_step=8,
                samples_per_prompt=4, actor_lr=3e-3, mini_batches=mini_batches, ppo_epochs=2,
                **task)
            out[mode] = _run(config)
            load.append(os.getloadavg()[0])
    base = out["sync"]
    others = list(MODES)[1:]
    lines = ["| | " + " | ".join(MODES.values()) + " | ratios to synchronous |",
             "|---" * (len(MODES) + 2) + "|",
             f"| step wall time (s, median of steps 2-{steps}) | "
             + " | ".join(f"{out[m]['step']:.2f}" for m in MODES) + " | "
             + ", ".join(f"{base['step'] / out[m]['step']:.2f}x" for m in others) + " |",
             f"| steps 2-{steps}, sum of step wall times (s) | "
             + " | ".join(f"{out[m]['steps_total']:.1f}" for m in MODES) + " | "
             + ", ".join(f"{base['steps_total'] / out[m]['steps_total']:.2f}x"
                         for m in others) + " |",
             *[f"| {p} (s, median) | " + " | ".join(f"{out[m]['phases'][p]:.3f}" for m in MODES)
               + " | |" for p in PHASES],
             "| trained response length (tokens, mean) | "
             + " | ".join(f"{out[m]['length']:.1f}" for m in MODES) + " | |",
             "| groups dropped as stale | "
             + " | ".join(f"{out[m]['dropped']:.0f}" for m in MODES) + " | |",
             "", "| step | " + " | ".join(str(i) for i in range(1, steps + 1)) + " |",
             "|---" * (steps + 1) + "|",
             *[f"| reward, {label} | " + " | ".join(f"{r:.3f}" for r in out[m]["reward"])
               + " |" for m, label in MODES.items()]]
    note = (f"1-minute load average during the run: {min(load):.1f} to {max(load):.1f}; "
            f"policy lag per step, one-step-off: {[int(x) for x in out['one_step_off']['lag']]},"
            f" fully async (over tokens, mean): "
            f"{[round(x, 2) for x in out['fully_async']['token_lag']]}.")
    table = "\n".join(lines) + "\n\n" + note
    print(table)
    return table, out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--mini-batches", type=int, default=4)
    parser.add_argument("--stop-ids", type=int, default=0,
                        help="token ids 0..K-1 end a sample (a long tail of lengths)")
    parser.add_argument("--episodes", action="store_true",
                        help="3-turn episodes of a toy chat model instead")
    parser.add_argument("--reward-latency", type=float, default=0.0,
                        help="seconds a local reward service takes to answer each request")
    parser.add_argument("--append", help="append the results to this markdown file")
    args = parser.parse_args()
    table, _ = measure(args.steps, args.new_tokens, args.mini_batches, args.stop_ids,
                       args.episodes, args.reward_latency)
    if args.append:
        task = "3-turn episodes" if args.episodes else "single-turn"
        append_entry(args.append, "Synchronous, one-step-off and fully asynchronous rollouts, "
                     f"disaggregated GRPO (tiny model, {task}): step rate and reward curves",
                     f"python -m bench.bench_async --steps {args.steps} "
                     f"--new-tokens {args.new_tokens} --mini-batches {args.mini_batches} "
                     f"--stop-ids {args.stop_ids}" + (" --episodes" if args.episodes else "")
                     + (f" --reward-latency {args.reward_latency}"
                        if args.reward_latency else ""),
                     table)


if __name__ == "__main__":
    main()
