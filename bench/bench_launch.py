"""Starting local ranks: a spawned interpreter per rank (the start method megarlhf used before)
against megarlhf's launcher (ranks forked from a server that imported megarlhf, torch and
megatron-core once; megarlhf/parallel/launcher.py).

Each launch runs, on every rank, a function that imports what a training rank imports
(megatron-core, megarlhf's models and engine) and returns its pid. Rounds interleave the two
ways; the table reports median seconds per launch of `--ranks` ranks, the first launcher
launch (which starts the server) apart, and the ratio paired within a round.

    python -m bench.bench_launch [--ranks 2] [--rounds 5] [--append BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import platform
import statistics
import subprocess
import time

from megarlhf.parallel import launch_local


def rank_imports() -> int:
    import megatron.core  # noqa: F401

    import megarlhf.engine.train  # noqa: F401
    import megarlhf.models.gpt  # noqa: F401

    return os.getpid()


def _spawned(ranks: int) -> float:
    """`ranks` spawned interpreters running rank_imports, as spawn_ranks used to start them."""
    ctx = mp.get_context("spawn")
    start = time.perf_counter()
    procs = [ctx.Process(target=rank_imports) for _ in range(ranks)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join()
        assert proc.exitcode == 0, proc.exitcode
    return time.perf_counter() - start


def _launcher(ranks: int) -> float:
    start = time.perf_counter()
    launch_local(rank_imports, ranks)
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> str:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--append", help="append the result to this Markdown file")
    args = p.parse_args(argv)
    first = _launcher(args.ranks)  # starts the server
    spawned, forked = [], []
    for _ in range(args.rounds):
        spawned.append(_spawned(args.ranks))
        forked.append(_launcher(args.ranks))
    ratios = [s / f for s, f in zip(spawned, forked)]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    text = (f"\n## {time.strftime('%Y-%m-%d')} Starting {args.ranks} local ranks that import "
            f"megatron-core and megarlhf's engine: spawned interpreters vs the launcher's "
            f"fork server\n\n"
            f"Machine: {os.cpu_count()}-core {platform.machine()} CPU, {platform.system()}; "
            f"at {commit}. `python -m bench.bench_launch --ranks {args.ranks} --rounds "
            f"{args.rounds}`\n\n"
            f"| start | seconds per launch (median of {args.rounds}) |\n|---|---|\n"
            f"| spawned interpreters (megarlhf before) | {statistics.median(spawned):.2f} |\n"
            f"| launcher, first launch (starts its server) | {first:.2f} |\n"
            f"| launcher, later launches | {statistics.median(forked):.3f} |\n\n"
            f"Spawned / later launcher launches, paired per round: median "
            f"{statistics.median(ratios):.0f}x.\n")
    print(text)
    if args.append:
        with open(args.append, "a") as f:
            f.write(text)
    return text


if __name__ == "__main__":
    main()
