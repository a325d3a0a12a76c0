"""Step time and peak memory per rank of the tiny model's training step, for each layout.

All layouts run in one invocation on the same machine, so the ratios to TP1xPP1 are
comparable even on a noisy machine; absolute CPU times mean little.

    python -m bench.bench_train_cpu [--steps N] [--append BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

from bench.report import append_entry
from megarlhf.engine.losses import lm_loss
from megarlhf.engine.optim import OptimConfig
from megarlhf.engine.schedule import rank_microbatches
from megarlhf.engine.train import TrainEngine
from megarlhf.models.gpt import model_spec
from megarlhf.models.presets import preset
from megarlhf.parallel import ParallelConfig as P
from megarlhf.parallel import init_mesh, launch_local
from megarlhf.data.embedded import byte_batches

MODEL = preset("tiny")
GLOBAL_BATCH, MICRO, SEQ = 16, 4, 64
LAYOUTS = [
    ("TP1xPP1", P(), 1),
    ("TP2xPP1", P(tensor_parallel=2), 2),
    ("TP1xPP2", P(pipeline_parallel=2), 2),
    ("TP2xPP2", P(tensor_parallel=2, pipeline_parallel=2), 4),
    ("TP2xPP2 vpp2", P(tensor_parallel=2, pipeline_parallel=2, virtual_pipeline_parallel=2), 4),
    ("TP2 +SP", P(tensor_parallel=2, sequence_parallel=True), 2),
    ("TP2xPP2xDP2", P(tensor_parallel=2, pipeline_parallel=2), 8),
]


def _rank(parallel: P, steps: int):
    mesh = init_mesh(parallel, seed=0)
    spec = model_spec(MODEL, parallel, layer_spec="local")
    engine = TrainEngine(spec, mesh, OptimConfig(lr=1e-3))
    loss_fn = lm_loss(mesh, MODEL.vocab_size)
    times = []
    for batch in byte_batches(seq=SEQ, batch=GLOBAL_BATCH, steps=steps):
        mbs = rank_microbatches(batch, mesh, MICRO)
        t0 = time.perf_counter()
        engine.train_step(mbs, loss_fn)
        times.append(time.perf_counter() - t0)
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return statistics.median(times[2:]), peak_mib


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--append", help="append the table to this markdown file")
    args = parser.parse_args()
    rows = []
    for name, parallel, nprocs in LAYOUTS:
        results = launch_local(_rank, nprocs, parallel, args.steps)
        step_s = max(r[0] for r in results)
        peak = max(r[1] for r in results)
        rows.append((name, nprocs, step_s, peak))
    base_step, base_mem = rows[0][2], rows[0][3]
    lines = [
        "| layout | ranks | step (ms, median) | step / TP1xPP1 | peak RSS per rank (MiB) "
        "| RSS / TP1xPP1 |",
        "|---|---|---|---|---|---|",
    ]
    lines += [f"| {n} | {r} | {s*1000:.0f} | {s/base_step:.2f} | {m:.0f} | {m/base_mem:.2f} |"
              for n, r, s, m in rows]
    table = "\n".join(lines)
    print(table)
    if args.append:
        append_entry(
            args.append,
            f"CPU training step, tiny model ({MODEL.num_layers} layers, hidden "
            f"{MODEL.hidden_size}), global batch {GLOBAL_BATCH} x seq {SEQ}, {MICRO} "
            f"micro-batches per DP rank, fp32, gloo",
            f"python -m bench.bench_train_cpu --steps {args.steps}", table)

if __name__ == "__main__":
    main()
