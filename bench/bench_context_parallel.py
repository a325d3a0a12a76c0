"""Long sequences under context parallelism: the actor's logprobs + one train step on rows of
4096 tokens (512 prompt + 3584 response) at CP1 (one rank) and CP2 (two ranks splitting
every row), with each rank's peak of live tensor bytes and the step's wall time.

The peak counts every tensor torch creates during the measured step (tests/live_bytes.py:
activations, logits, the attention scores of megatron-core's local attention, collectives'
buffers), not the weights, gradient buffers and Adam states that exist before it (a first
step, unmeasured, creates the Adam states). Each rank runs one row per micro-batch, so the
peak is one micro-batch's forward + backward. On CPU the local attention keeps its
[heads, s, s] scores (s / CP query rows per rank under CP): the share CP removes from them is
the same as from every other per-token term.

    python -m bench.bench_context_parallel [--seq 4096] [--append BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.report import append_entry
from megarlhf.data.sequences import SequenceBatch
from megarlhf.engine.optim import OptimConfig
from megarlhf.engine.train import TrainEngine
from megarlhf.models.config import ModelConfig
from megarlhf.models.gpt import model_spec
from megarlhf.parallel import ParallelConfig, init_mesh, launch_local
from megarlhf.roles.batching import Batching
from megarlhf.roles.policy import PolicyRole
from tests.live_bytes import LiveBytes

MIB = 2**20
ROWS, PROMPT = 2, 512


def model(seq: int) -> ModelConfig:
    return ModelConfig(num_layers=4, hidden_size=512, ffn_hidden_size=1408,
                       num_attention_heads=8, num_kv_heads=4, vocab_size=32000,
                       max_position_embeddings=seq)


def rollout_batch(seq: int, vocab: int) -> SequenceBatch:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, vocab, (ROWS, seq), generator=g)
    response = torch.zeros(ROWS, seq, dtype=torch.long)
    response[:, PROMPT:] = 1
    return SequenceBatch(tokens=tokens, attention_mask=torch.ones_like(tokens),
                         response_mask=response)


def _rank(cp: int, seq: int) -> dict:
    parallel = ParallelConfig(context_parallel=cp)
    mesh = init_mesh(parallel, seed=0)
    m = model(seq)
    engine = TrainEngine(model_spec(m, parallel, layer_spec="local", on_gpu=False), mesh,
                         OptimConfig(lr=1e-6))
    role = PolicyRole(engine, batching=Batching(ROWS))
    batch = rollout_batch(seq, m.vocab_size)
    advantages = torch.randn(batch.shape, generator=torch.Generator().manual_seed(1))
    out = {}
    for measured in (False, True):
        t = time.perf_counter()
        with LiveBytes() as live:
            logp = role.logprobs(batch)
            step, _ = role.train_step(batch, logp, advantages)
        out = {"peak": live.peak, "seconds": time.perf_counter() - t, "loss": step.loss,
               "grad_norm": step.grad_norm} if measured else out
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--append", help="append the table to this markdown file")
    args = parser.parse_args()
    runs = {cp: launch_local(_rank, cp, cp, args.seq) for cp in (1, 2)}
    base = runs[1][0]
    lines = ["| layout | rank | peak live tensors (MiB) | vs CP1 | step (s) | loss | grad norm |",
             "|---|---|---|---|---|---|---|"]
    for cp, ranks in runs.items():
        for rank, r in enumerate(ranks):
            lines.append(f"| CP{cp} | {rank} | {r['peak'] / MIB:.0f} | "
                         f"{r['peak'] / base['peak']:.2f} | {r['seconds']:.1f} | "
                         f"{r['loss']:.6f} | {r['grad_norm']:.6f} |")
    m = model(args.seq)
    table = "\n".join(lines) + (
        f"\n\nRows: {ROWS} of {args.seq} tokens ({PROMPT} prompt + {args.seq - PROMPT} "
        f"response), one row per micro-batch; the actor's logprobs, then one optimizer step "
        f"(the second: the first creates the Adam states). Model: {m.num_layers} layers, "
        f"hidden {m.hidden_size}, {m.num_attention_heads} heads / {m.num_kv_heads} KV heads, "
        f"vocabulary {m.vocab_size}, fp32, local attention.")
    print(table)
    if args.append:
        append_entry(args.append,
                     f"Context parallelism on {args.seq}-token rows: peak memory per rank, "
                     f"CP2 vs CP1", f"python -m bench.bench_context_parallel --seq {args.seq}",
                     table)


if __name__ == "__main__":
    main()
