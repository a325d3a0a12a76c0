"""The actor's work in a PPO step (logprobs of the rollout batch, then one optimizer step on
it) with micro-batches padded, padded by token budget, and packed (megarlhf/roles/
batching.py), side by side in one run on one rank.

The rollout batch has a realistic spread of response lengths: 8 prompts of 32-96 tokens x 4
samples, responses log-normal around 96 tokens (sigma 1) cut to 8..max_new_tokens=512 tokens,
as reasoning-style sampling gives: most short, a few running to the limit. Padded, every
micro-batch is as long as its longest row; a token budget groups rows of similar length;
packed, no position is padding, but attention runs over the packed row under a
block-diagonal mask (a dense mask on CPU, so its cost grows with the budget's square).

    python -m bench.bench_packing [--repeats 3] [--budget 1024] [--append BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import statistics
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

MODEL = ModelConfig(num_layers=4, hidden_size=512, ffn_hidden_size=1408,
                    num_attention_heads=8, num_kv_heads=8, vocab_size=32000,
                    max_position_embeddings=1024)
PROMPTS, SAMPLES, MAX_NEW = 8, 4, 512


def rollout_batch(seed: int = 0) -> SequenceBatch:
    """[pad | prompt | response | pad] rows with the spread described above."""
    g = torch.Generator().manual_seed(seed)
    rows = PROMPTS * SAMPLES
    prompt_len = torch.randint(32, 97, (PROMPTS,), generator=g).repeat_interleave(SAMPLES)
    response_len = (96 * torch.exp(torch.randn(rows, generator=g))).round().clamp(8, MAX_NEW)
    P, T = int(prompt_len.max()), int(prompt_len.max()) + MAX_NEW
    tokens = torch.randint(1, MODEL.vocab_size, (rows, T), generator=g)
    attention, response = torch.zeros(rows, T, dtype=torch.long), torch.zeros(rows, T,
                                                                             dtype=torch.long)
    for r in range(rows):
        p, n = int(prompt_len[r]), int(response_len[r])
        attention[r, P - p:P + n] = 1
        response[r, P:P + n] = 1
    return SequenceBatch(tokens=torch.where(attention.bool(), tokens, 0),
                         attention_mask=attention, response_mask=response)


def _rank(repeats: int, budget: int) -> dict:
    mesh = init_mesh(ParallelConfig(), seed=0)
    engine = TrainEngine(model_spec(MODEL, ParallelConfig(), layer_spec="local", on_gpu=False),
                         mesh, OptimConfig(lr=1e-6))
    batch = rollout_batch()
    ways = {"padded, 4 micro-batches": Batching(4),
            f"padded, token budget {budget}": Batching(max_tokens=budget),
            f"packed, token budget {budget}": Batching(max_tokens=budget, pack=True)}
    times = {name: [] for name in ways}
    advantages = torch.randn(batch.shape, generator=torch.Generator().manual_seed(1))
    for i in range(repeats + 1):  # the first round warms up
        for name, batching in ways.items():
            role = PolicyRole(engine, batching=batching)
            t = time.perf_counter()
            logp = role.logprobs(batch)
            role.train_step(batch, logp, advantages)
            if i:
                times[name].append(time.perf_counter() - t)
    real = int(batch.attention_mask.sum())
    return {"times": {k: statistics.median(v) for k, v in times.items()},
            "real_tokens": real, "padded_tokens": batch.tokens.numel(),
            "response_lengths": batch.response_mask.sum(1).tolist()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--append", help="append the table to this markdown file")
    args = parser.parse_args()
    out = launch_local(_rank, 1, args.repeats, args.budget)[0]
    times = out["times"]
    base = times["padded, 4 micro-batches"]
    lengths = sorted(out["response_lengths"])
    lines = ["| micro-batches | actor step (s, median) | speed-up over padded |",
             "|---|---|---|"]
    lines += [f"| {name} | {t:.2f} | {base / t:.2f}x |" for name, t in times.items()]
    table = "\n".join(lines) + (
        f"\n\nBatch: {len(lengths)} rows, {out['real_tokens']} real tokens in "
        f"{out['padded_tokens']} padded positions; response lengths min {lengths[0]}, median "
        f"{lengths[len(lengths) // 2]}, max {lengths[-1]}.")
    print(table)
    if args.append:
        append_entry(args.append,
                     "Packed vs padded micro-batches: the actor's logprobs + one train step on "
                     f"a rollout batch with spread response lengths ({MODEL.num_layers} layers, "
                     f"hidden {MODEL.hidden_size}, vocabulary {MODEL.vocab_size}, fp32, 1 rank)",
                     f"python -m bench.bench_packing --repeats {args.repeats} "
                     f"--budget {args.budget}", table)


if __name__ == "__main__":
    main()
