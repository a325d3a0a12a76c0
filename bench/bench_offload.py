"""What offloading an idle role costs (megarlhf/engine/offload.py): each kind's round trip
(offload, then reload) against a plain copy of the same bytes there and back, on one rank
of a bf16 Llama-shaped model with Adam's state, in one run.

On a CPU-only machine the "device" is host memory, so this measures the mechanism's
overhead over memcpy (storage bookkeeping, the resize's free and allocate, zeroing the
grads), not a PCIe transfer; on a GPU the copies run over the bus to pinned memory.

    python -m bench.bench_offload [--repeats N] [--append BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.report import append_entry
from megarlhf.engine.losses import lm_loss
from megarlhf.engine.offload import KINDS, Offloader, storages_of
from megarlhf.engine.optim import OptimConfig
from megarlhf.engine.schedule import rank_microbatches
from megarlhf.engine.train import TrainEngine
from megarlhf.models.config import ModelConfig
from megarlhf.models.gpt import model_spec
from megarlhf.parallel import ParallelConfig, init_mesh, launch_local

# SmolLM2-135M's shape with a smaller vocabulary (the embedding is not what is measured).
MODEL = ModelConfig(num_layers=30, hidden_size=576, ffn_hidden_size=1536,
                    num_attention_heads=9, num_kv_heads=3, vocab_size=32000,
                    max_position_embeddings=2048, tie_embeddings=True)


def _rank(repeats: int) -> list[tuple]:
    mesh = init_mesh(ParallelConfig(), seed=0)
    spec = model_spec(MODEL, ParallelConfig(), layer_spec="local", on_gpu=False,
                      dtype=torch.bfloat16)
    engine = TrainEngine(spec, mesh, OptimConfig(lr=1e-5))
    tokens = torch.randint(0, MODEL.vocab_size, (2, 65))
    batch = {"tokens": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous(),
             "loss_mask": torch.ones(2, 64),
             "position_ids": torch.arange(64).expand(2, 64).contiguous()}
    engine.train_step(rank_microbatches(batch, mesh, 1), lm_loss(mesh, MODEL.vocab_size))
    offloader = Offloader(engine)
    rows = []
    for kind in KINDS:
        nbytes = sum(s.nbytes() for s in storages_of([offloader.tensors(kind)]).values())
        trips, copies = [], []
        for _ in range(repeats):
            t = time.perf_counter()
            offloader.offload([kind])
            offloader.reload([kind])
            trips.append(time.perf_counter() - t)
            source = [torch.empty(0, dtype=torch.uint8).set_(s)
                      for s in storages_of([offloader.tensors(kind)]).values()]
            t = time.perf_counter()
            host = [s.clone() for s in source]
            for s, h in zip(source, host):
                s.copy_(h)
            copies.append(time.perf_counter() - t)
            del host
        rows.append((kind, nbytes, statistics.median(trips), statistics.median(copies)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--append", help="append the table to this markdown file")
    args = parser.parse_args()
    rows = launch_local(_rank, 1, args.repeats)[0]
    lines = ["| kind | bytes (MiB) | round trip (ms, median) | copy there and back (ms) "
             "| round trip / copy | GB/s (2 x bytes / round trip) |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {kind} | {n / 2**20:.0f} | {trip * 1e3:.0f} | {copy * 1e3:.0f} "
              f"| {trip / copy:.2f} | {2 * n / trip / 1e9:.1f} |"
              for kind, n, trip, copy in rows]
    table = "\n".join(lines)
    print(table)
    if args.append:
        append_entry(args.append,
                     "Offload round trip per kind of state vs a plain copy of the same bytes "
                     f"(bf16, {MODEL.num_layers} layers, hidden {MODEL.hidden_size}, Adam)",
                     f"python -m bench.bench_offload --repeats {args.repeats}", table)


if __name__ == "__main__":
    main()
