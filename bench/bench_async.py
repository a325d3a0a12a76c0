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
fully asynchronous mode scores finished groups while the engine generates the others. With
--stale-groups wait,drop, a fully asynchronous column for each stale_groups: the step that is
the last allowed to train a late group waits for it, or the steps go on without it and drop
it (on the long-tail workload, the late groups are the long answers).

    python -m bench.bench_async [--steps 15] [--new-tokens 48] [--mini-batches 4]
                                [--stop-ids 0] [--episodes] [--reward-latency 0]
                                [--stale-groups wait] [--append BENCHMARKS.md]
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
            # stale_groups=drop: the dropped groups' mean length, over the run (groups weigh
            # alike: each has samples_per_prompt samples)
            "dropped_length": _weighted([(m["rollout/stale_dropped_length_mean"],
                                          m["rollout/stale_dropped"]) for m in history
                                         if m.get("rollout/stale_dropped")]),
            "staleness_wait": sum(m.get("time/staleness_wait", 0.0) for m in history[1:]),
            "lag": [m["rollout/policy_lag"] for m in history],
            "token_lag": [m.get("rollout/policy_lag_mean", m["rollout/policy_lag"])
                          for m in history]}


def _weighted(pairs: list[tuple[float, float]]) -> float:
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total else float("nan")


MODES = {"sync": "synchronous", "one_step_off": "one-step-off", "fully_async": "fully async"}


def _columns(stale_groups: tuple[str, ...]) -> dict[str, tuple[str, str, str]]:
    """Column -> (label, rollout_mode, stale_groups): a fully asynchronous one per rule."""
    out = {mode: (label, mode, "wait") for mode, label in MODES.items() if mode != "fully_async"}
    for rule in stale_groups:
        key, label = ("fully_async", MODES["fully_async"]) if len(stale_groups) == 1 else (
            f"fully_async/{rule}", f"{MODES['fully_async']} ({rule})")
        out[key] = (label, "fully_async", rule)
    return out


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
            episodes: bool = False, reward_latency: float = 0.0,
            stale_groups: tuple[str, ...] = ("wait",)) -> tuple[str, dict]:
    from megarlhf.ppo.config import PPOConfig
    from tests.reward_server import RewardServer

    columns = _columns(stale_groups)
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
        for key, (_, mode, rule) in columns.items():
            config = PPOConfig(
                out_dir=os.path.join(tmp, key.replace("/", "_")), algorithm="grpo",
                rollout_correction="tis", placement="disaggregated", rollout_mode=mode,
                max_staleness=1, stale_groups=rule, partial_rollout_tokens=16, steps=steps,
                prompts_per_step=8, samples_per_prompt=4, actor_lr=3e-3,
                mini_batches=mini_batches, ppo_epochs=2, **task)
            out[key] = _run(config)
            load.append(os.getloadavg()[0])
    base = out["sync"]
    others = list(columns)[1:]
    streams = [key for key, (_, mode, _) in columns.items() if mode == "fully_async"]

    def row(name: str, cell) -> str:
        return f"| {name} | " + " | ".join(cell(out[m]) for m in columns) + " | |"

    lines = ["| | " + " | ".join(label for label, _, _ in columns.values())
             + " | ratios to synchronous |",
             "|---" * (len(columns) + 2) + "|",
             f"| step wall time (s, median of steps 2-{steps}) | "
             + " | ".join(f"{out[m]['step']:.2f}" for m in columns) + " | "
             + ", ".join(f"{base['step'] / out[m]['step']:.2f}x" for m in others) + " |",
             f"| steps 2-{steps}, sum of step wall times (s) | "
             + " | ".join(f"{out[m]['steps_total']:.1f}" for m in columns) + " | "
             + ", ".join(f"{base['steps_total'] / out[m]['steps_total']:.2f}x"
                         for m in others) + " |",
             *[row(f"{p} (s, median)", lambda r, p=p: f"{r['phases'][p]:.3f}")
               for p in PHASES],
             row(f"staleness_wait (s, sum over steps 2-{steps})",
                 lambda r: f"{r['staleness_wait']:.3f}"),
             row("trained response length (tokens, mean)", lambda r: f"{r['length']:.1f}"),
             row("groups dropped as stale", lambda r: f"{r['dropped']:.0f}"),
             row("dropped groups' response length (tokens, mean)",
                 lambda r: f"{r['dropped_length']:.1f}"),
             "", "| step | " + " | ".join(str(i) for i in range(1, steps + 1)) + " |",
             "|---" * (steps + 1) + "|",
             *[f"| reward, {label} | " + " | ".join(f"{r:.3f}" for r in out[m]["reward"])
               + " |" for m, (label, _, _) in columns.items()]]
    note = (f"1-minute load average during the run: {min(load):.1f} to {max(load):.1f}; "
            f"policy lag per step, one-step-off: {[int(x) for x in out['one_step_off']['lag']]}"
            + "".join(f", {columns[m][0]} (over tokens, mean): "
                      f"{[round(x, 2) for x in out[m]['token_lag']]}" for m in streams) + ".")
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
    parser.add_argument("--stale-groups", default="wait",
                        help="comma-separated stale_groups rules (wait, drop): a fully "
                             "asynchronous column each")
    parser.add_argument("--append", help="append the results to this markdown file")
    args = parser.parse_args()
    rules = tuple(args.stale_groups.split(","))
    table, _ = measure(args.steps, args.new_tokens, args.mini_batches, args.stop_ids,
                       args.episodes, args.reward_latency, rules)
    if args.append:
        task = "3-turn episodes" if args.episodes else "single-turn"
        append_entry(args.append, "Synchronous, one-step-off and fully asynchronous rollouts"
                     + (f" ({' vs '.join(f'stale_groups={r}' for r in rules)})"
                        if len(rules) > 1 else "") + ", "
                     f"disaggregated GRPO (tiny model, {task}): step rate and reward curves",
                     f"python -m bench.bench_async --steps {args.steps} "
                     f"--new-tokens {args.new_tokens} --mini-batches {args.mini_batches} "
                     f"--stop-ids {args.stop_ids}" + (" --episodes" if args.episodes else "")
                     + (f" --reward-latency {args.reward_latency}"
                        if args.reward_latency else "")
                     + (f" --stale-groups {args.stale_groups}"
                        if args.stale_groups != "wait" else ""),
                     table)


if __name__ == "__main__":
    main()
