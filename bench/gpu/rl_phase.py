"""7. An RL training phase: the actor's two passes of a PPO step on rollout-shaped rows.

A GRPO/PPO step's training side is the old-logprob pass (forward only) and the update
(forward and backward, one optimizer step), over left-padded rows of a prompt and a response
of varied lengths, cut into packed micro-batches by a token budget (pack_sequences with
max_tokens_per_micro_batch). Both are timed on the training preset in the benchmark's dtype.

FLOPs count only the matmul weights over the rows' real tokens (2N per token forward, 6N
forward + backward; padding is never computed when packed): attention's S x S term depends
on each sequence's length and is left out, so the MFU here is a slight underestimate.
"""

from __future__ import annotations

import torch

from bench.gpu.common import ONE_RANK, Row, dtype_name, mesh_here, timed
from bench.gpu.mfu import matmul_params, mfu
from bench.gpu.plan import Sizes
from megarlhf.models.presets import preset


def rows(vocab: int, sizes: Sizes, seed: int = 0):
    """Left-padded rows: prompts of 1/8..1/4 of the row, the response filling a random
    share of the rest (a rollout's mix of short and long answers)."""
    from megarlhf.data.sequences import SequenceBatch

    g = torch.Generator().manual_seed(seed)
    width = sizes.rl_seq
    tokens = torch.zeros(sizes.rl_rows, width, dtype=torch.long)
    attention = torch.zeros(sizes.rl_rows, width)
    response = torch.zeros(sizes.rl_rows, width)
    for r in range(sizes.rl_rows):
        prompt = int(torch.randint(width // 8, width // 4 + 1, (), generator=g))
        answer = int(torch.randint(1, width - prompt + 1, (), generator=g))
        start = width - prompt - answer
        tokens[r, start:] = torch.randint(0, vocab, (prompt + answer,), generator=g)
        attention[r, start:] = 1
        response[r, width - answer:] = 1
    return SequenceBatch(tokens=tokens, attention_mask=attention, response_mask=response)


def phase_rank(sizes: Sizes) -> dict:
    from megarlhf.engine.optim import OptimConfig
    from megarlhf.engine.train import TrainEngine
    from megarlhf.models.gpt import model_spec
    from megarlhf.roles.batching import Batching
    from megarlhf.roles.policy import PolicyRole

    mesh, on_gpu = mesh_here()
    model = preset(sizes.train_preset)
    spec = model_spec(model, ONE_RANK, dtype=sizes.dtype, on_gpu=on_gpu)
    actor = PolicyRole(TrainEngine(spec, mesh, OptimConfig(lr=1e-6)),
                       batching=Batching(max_tokens=sizes.rl_tokens_per_mb, pack=True))
    batch = rows(model.vocab_size, sizes)
    advantages = torch.randn(batch.shape, generator=torch.Generator().manual_seed(1))
    old = actor.logprobs(batch)  # warm-up: kernels, allocator
    actor.train_step(batch, old, advantages)
    logprob_s, update_s = [], []
    for _ in range(sizes.steps):
        logprob_s.append(timed(lambda: actor.logprobs(batch), mesh.device))
        update_s.append(timed(lambda: actor.train_step(batch, old, advantages), mesh.device))
    return {"tokens": int(batch.attention_mask.sum()), "logprob_s": min(logprob_s),
            "update_s": min(update_s), "spec": spec.layer_spec}


def measure(sizes: Sizes, run, peak: tuple[float, str] | None, no_peak: str) -> list[Row]:
    out = run(phase_rank, sizes)
    n = matmul_params(preset(sizes.train_preset))
    setting = (f"{sizes.train_preset}, {dtype_name(sizes.dtype)}, {sizes.rl_rows} rows of "
               f"<= {sizes.rl_seq} tokens ({out['tokens']:,} real), packed micro-batches of "
               f"<= {sizes.rl_tokens_per_mb} tokens, spec {out['spec']}")
    result = []
    for name, seconds, flops in (("old-logprob pass", out["logprob_s"], 2 * n),
                                 ("update (forward, backward, step)", out["update_s"], 6 * n)):
        tokens_s = out["tokens"] / seconds
        line = f"{name}: {tokens_s:,.0f} tokens/s ({seconds:.3f} s, best of {sizes.steps})"
        if peak is not None:
            line += f", MFU {100 * mfu(flops, tokens_s, peak[0]):.1f}% (matmuls only)"
        result.append(line)
    if peak is None:
        result.append(f"MFU not computed: {no_peak}")
    return [("", setting, "; ".join(result))]
