"""PPO step time: the per-phase breakdown, the controller's overhead, and colocated vs
disaggregated placement on the same tiny setup, side by side in one run.

Setup (the one tests/test_ppo.py trains): the tiny preset (4 layers, hidden 64, vocabulary
300) as actor, ref and critic from seed-0 weights, PPO on the low-token task, 8 prompts x 2
samples of 8 new tokens per step, 2 epochs x 2 mini-batches, Megatron rollouts. Each
configuration is one `run()` of `--steps` steps; the first step (warm-up) is dropped and the
medians of the others are reported.

Per phase (rollout, experience, train, sync): the controller's time (from issuing the phase
to having its results, with the controller's own work in that phase) and the workers' time
(inside the worker method, slowest rank; concurrent groups count once). Controller overhead =
step wall time - the workers' phase times: the loop's own tensor work (rollout batch,
rewards, advantages, metrics), moving arguments and results, and the wait for the slowest
rank to be asked and to answer.

    python -m bench.bench_ppo [--steps 10] [--nproc 1] [--tp 1] [--groups local,ray]
                              [--append BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from bench.report import append_entry
from megarlhf.models.presets import preset
from megarlhf.parallel import launch_local

MODEL = preset("tiny")
PHASES = ("rollout", "experience", "train", "sync")
PLACEMENTS = ("colocated", "disaggregated")


def _write_references(actor: str, critic: str) -> None:
    """One rank: the seed-0 LM and value model (weights only)."""
    from megarlhf.engine.checkpoint import save_checkpoint
    from megarlhf.engine.train import TrainEngine
    from megarlhf.models.gpt import model_spec
    from megarlhf.parallel.mesh import ParallelConfig, init_mesh

    for path, value_head in ((actor, False), (critic, True)):
        mesh = init_mesh(ParallelConfig(), seed=0)
        engine = TrainEngine(model_spec(MODEL, ParallelConfig(), value_head=value_head), mesh)
        save_checkpoint(path, engine, mesh, with_optimizer=False)


def write_inputs(tmp: str) -> tuple[str, str, str]:
    """The setup's actor, critic and prompts written under `tmp`; their paths."""
    actor, critic, prompts = (os.path.join(tmp, n) for n in ("actor", "critic", "p.jsonl"))
    launch_local(_write_references, 1, actor, critic)
    _write_prompts(prompts)
    return actor, critic, prompts


def _write_prompts(path: str) -> None:
    g = torch.Generator().manual_seed(0)
    with open(path, "w") as f:
        for _ in range(32):
            n = int(torch.randint(2, 6, (), generator=g))
            ids = torch.randint(1, MODEL.vocab_size, (n,), generator=g).tolist()
            f.write(json.dumps({"prompt_ids": ids}) + "\n")


def _measure(config) -> dict:
    from megarlhf.ppo.controller import run
    from megarlhf.ppo.placement import group_specs

    start = time.perf_counter()
    history = run(config)
    total = time.perf_counter() - start
    steps = history[1:]

    def median(key: str) -> float:
        return statistics.median(m.get(key, 0.0) for m in steps)

    return {
        "ranks": sum(g.nproc for g in group_specs(config)),
        "wall": median("time/wall"),
        "overhead": median("time/controller_overhead"),
        "overhead_frac": statistics.median(m["time/controller_overhead"] / m["time/wall"]
                                           for m in steps),
        "controller": {p: median(f"time/{p}") for p in PHASES},
        "worker": {p: median(f"time/worker/{p}") for p in PHASES},
        "outside_steps": total - sum(m["time/wall"] for m in history),
        "reward": [round(m["reward/mean"], 4) for m in history],
    }


def _table(results: dict[tuple[str, str], dict]) -> str:
    keys = list(results)
    head = "| | " + " | ".join(f"{p}, {g} ({results[(g, p)]['ranks']} ranks)"
                                for g, p in keys) + " |"
    rows = [head, "|---" * (len(keys) + 1) + "|"]

    def row(label: str, cell) -> None:
        rows.append(f"| {label} | " + " | ".join(cell(results[k], k) for k in keys) + " |")

    row("step wall time (s, median)", lambda r, k: f"{r['wall']:.3f}")
    for p in PHASES:
        row(f"{p}: controller / workers (s)",
            lambda r, k, p=p: f"{r['controller'][p]:.3f} / {r['worker'][p]:.3f}")
    row("controller overhead (s, % of step)",
        lambda r, k: f"{r['overhead']:.4f}, {100 * r['overhead_frac']:.1f}%")
    row("step time / colocated (same groups)",
        lambda r, k: f"{r['wall'] / results[(k[0], 'colocated')]['wall']:.2f}")
    row("start-up + checkpoint + shutdown (s)", lambda r, k: f"{r['outside_steps']:.0f}")
    return "\n".join(rows)


def measure(steps: int, nproc: int, tp: int, groups: list[str]) -> dict:
    from megarlhf.ppo.config import PPOConfig

    load = [os.getloadavg()[0]]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        actor, critic, prompts = write_inputs(tmp)
        for group in groups:
            for placement in PLACEMENTS:
                config = PPOConfig(
                    actor=actor, critic=critic, prompts=prompts,
                    out_dir=os.path.join(tmp, f"{group}-{placement}"),
                    reward_fn="tests.ppo_tasks:low_token_fraction", nproc=nproc,
                    tensor_parallel=tp, steps=steps, prompts_per_step=8, samples_per_prompt=2,
                    max_new_tokens=8, ppo_epochs=2, mini_batches=2, actor_lr=3e-3,
                    critic_lr=1e-3, kl_coef=0.01, placement=placement, worker_group=group)
                results[(group, placement)] = _measure(config)
                load.append(os.getloadavg()[0])
    table = _table(results)
    same = all(results[(g, "colocated")]["reward"] == results[(g, "disaggregated")]["reward"]
               for g in groups)
    note = (f"Tiny preset (4 layers, hidden 64, vocab 300) as actor / ref / critic at "
            f"TP{tp} x {nproc // tp} DP per model group, Megatron rollouts; 8 prompts x 2 "
            f"samples x 8 new tokens per step, 2 epochs x 2 mini-batches; {steps} steps per "
            f"configuration, medians of steps 2-{steps}. Disaggregated: actor, critic and ref "
            f"groups of {nproc} rank(s) each plus 1 rollout rank. Per-step rewards equal "
            f"between the placements: {same}. 1-minute load average during the run: "
            f"{min(load):.1f} to {max(load):.1f}.")
    print(table)
    print(note)
    return {"table": table, "note": note, "results": {f"{g} {p}": r
                                                      for (g, p), r in results.items()}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--nproc", type=int, default=1, help="ranks per model group")
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--groups", default="local,ray",
                        help="worker groups to measure, comma-separated: local, ray")
    parser.add_argument("--append", help="append the results to this markdown file")
    args = parser.parse_args()
    out = measure(args.steps, args.nproc, args.tp, args.groups.split(","))
    if args.append:
        command = (f"python -m bench.bench_ppo --steps {args.steps} --nproc {args.nproc} "
                   f"--tp {args.tp} --groups {args.groups}")
        append_entry(args.append, "PPO step: per-phase time, controller overhead, colocated "
                     "vs disaggregated (tiny model)", command,
                     f"{out['table']}\n\n{out['note']}",
                     machine_extra=f"gloo, no GPU; uname -a: {' '.join(os.uname())}")


if __name__ == "__main__":
    main()
