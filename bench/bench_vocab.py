"""Per-token logprobs + entropy from TP-sharded logits: vocab-parallel vs gather-then-log_softmax.

Both methods compute log p(labels) and the entropy for B x T tokens from this rank's vocabulary
slice at TP2, forward and backward (gradient w.r.t. the local slice), in fp32 on CPU:

  vocab-parallel  `vocab_parallel_logprobs_and_entropy` (two all-reduces of [B, T] sums)
  gather          all-gather the slices into [B, T, V], log_softmax, entropy from it, gradient
                  of the full logits cut back to the local slice (Megatron's gather backward)

Each method runs in fresh rank processes, so the peak-RSS high-water mark belongs to it alone:
we report the peak RSS minus the RSS after the inputs are allocated (per rank, the max over
ranks), and the median step time after one warm-up step. Both methods run in one invocation
and their outputs are checked against each other.

Legend: B batch, T time, V vocabulary (V/tp: one rank's slice).

    python -m bench.bench_vocab [--iters 6] [--append BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time

import torch
import torch.distributed as dist

from bench.report import append_entry
from megarlhf.parallel import ParallelConfig, init_mesh, launch_local
from megarlhf.parallel.vocab import vocab_parallel_logprobs_and_entropy

VOCAB, BATCH, SEQ, TP = 128256, 2, 512, 2  # Llama 3 vocabulary (divisible by 2 * 128: no padding)


def _rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _vocab_parallel(local_BTV, labels_BT, mesh, start):
    return vocab_parallel_logprobs_and_entropy(local_BTV, labels_BT, tp_group=mesh.tp_group,
                                               vocab_start=start, vocab_size=VOCAB)


class _GatherVocab(torch.autograd.Function):
    """All-gather the vocabulary slices; backward keeps this rank's slice of the gradient
    (what megatron-core's gather_from_tensor_model_parallel_region does)."""

    @staticmethod
    def forward(ctx, local_BTV, group, start):
        parts = [torch.empty_like(local_BTV) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local_BTV.contiguous(), group=group)
        ctx.start, ctx.width = start, local_BTV.shape[-1]
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad_BTV):
        return grad_BTV[..., ctx.start:ctx.start + ctx.width].clone(), None, None


def _gathered(local_BTV, labels_BT, mesh, start):
    full_BTV = _GatherVocab.apply(local_BTV, mesh.tp_group, start)[..., :VOCAB]
    logp_all = torch.log_softmax(full_BTV, dim=-1)
    logp_BT = logp_all.gather(-1, labels_BT.unsqueeze(-1)).squeeze(-1)
    entropy_BT = -(logp_all.exp() * logp_all).sum(-1)
    return logp_BT, entropy_BT


METHODS = {"vocab-parallel": _vocab_parallel, "gather": _gathered}


def _inputs(tp_rank: int):
    """Labels and loss weights (the same on every rank), and this rank's slice of the logits."""
    g = torch.Generator().manual_seed(0)
    labels_BT = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
    w_logp, w_entropy = torch.randn(BATCH, SEQ, generator=g), torch.randn(BATCH, SEQ, generator=g)
    g.manual_seed(1 + tp_rank)
    # In place: a transient copy would raise the RSS high-water mark before the baseline.
    return labels_BT, w_logp, w_entropy, torch.randn(BATCH, SEQ, VOCAB // TP, generator=g).mul_(3)


def _rank(method: str, iters: int):
    mesh = init_mesh(ParallelConfig(tensor_parallel=TP))
    start = mesh.tp_rank * VOCAB // mesh.tp
    labels_BT, w_logp, w_entropy, local_BTV = _inputs(mesh.tp_rank)
    local_BTV.requires_grad_()
    dist.barrier(group=mesh.tp_group)
    base = _rss_mib()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        logp_BT, entropy_BT = METHODS[method](local_BTV, labels_BT, mesh, start)
        (grad_BTV,) = torch.autograd.grad((logp_BT * w_logp + entropy_BT * w_entropy).sum(),
                                          local_BTV)
        times.append(time.perf_counter() - t0)
        peak = _rss_mib() - base  # before the checks below allocate anything
        check = {"logp": logp_BT.detach(), "entropy": entropy_BT.detach(),
                 "grad_head": grad_BTV[..., :256].clone(), "grad_sum": grad_BTV.sum()}
        del logp_BT, entropy_BT, grad_BTV  # nothing of this step lives into the next
        dist.barrier(group=mesh.tp_group)
    return statistics.median(times[1:]), peak, base, check


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=6)
    parser.add_argument("--append", help="append the table to this markdown file")
    args = parser.parse_args()
    rows = {}
    for method in METHODS:
        results = launch_local(_rank, TP, method, args.iters)
        rows[method] = (max(r[0] for r in results), max(r[1] for r in results),
                        max(r[2] for r in results), [r[3] for r in results])
    # Same numbers from both, rank by rank. fp32: the gathered entropy sums 128k products
    # p*log p in fp32 and is off by up to ~1e-4 (see the float64 errors printed below).
    for a, b in zip(rows["vocab-parallel"][3], rows["gather"][3]):
        for key, tol in (("logp", 1e-4), ("entropy", 1e-3), ("grad_head", 1e-5)):
            torch.testing.assert_close(a[key], b[key], atol=tol, rtol=0, msg=key)
        torch.testing.assert_close(a["grad_sum"], b["grad_sum"], atol=1e-2, rtol=0)
    # Accuracy against float64 on the first 64 tokens.
    labels_BT, _, _, shard = _inputs(0)
    full = torch.cat([shard[:1, :64], _inputs(1)[3][:1, :64]], dim=-1).double()
    del shard
    logp_all = torch.log_softmax(full, dim=-1)
    want = {"logp": logp_all.gather(-1, labels_BT[:1, :64, None])[..., 0],
            "entropy": -(logp_all.exp() * logp_all).sum(-1)}
    errors = {name: {k: float((r[3][0][k][:1, :64].double() - want[k]).abs().max())
                     for k in want} for name, r in rows.items()}
    base_t, base_m = rows["gather"][0], rows["gather"][1]
    logits_mib = BATCH * SEQ * VOCAB // TP * 4 / 2**20
    lines = [
        "| method | step fwd+bwd (ms, median) | time / gather | peak RSS delta per rank (MiB) "
        "| memory / gather | delta / local logits | max error vs fp64 (logp, entropy) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, (t, m, _, _) in rows.items():
        e = errors[name]
        lines.append(f"| {name} | {t * 1000:.0f} | {t / base_t:.2f} | {m:.0f} | "
                     f"{m / base_m:.2f} | {m / logits_mib:.1f} | "
                     f"{e['logp']:.1e}, {e['entropy']:.1e} |")
    table = "\n".join(lines)
    print(table)
    print(f"local logits per rank: {logits_mib:.0f} MiB; RSS before the first step: "
          f"{max(r[2] for r in rows.values()):.0f} MiB")
    if args.append:
        append_entry(
            args.append,
            f"vocab-parallel logprobs + entropy vs gather-then-log_softmax, TP{TP}, vocab "
            f"{VOCAB}, {BATCH} x {SEQ} tokens, fp32, forward + backward",
            f"python -m bench.bench_vocab --iters {args.iters}", table, machine_extra="gloo")


if __name__ == "__main__":
    main()
