"""Small text shipped with the package so the demo and tests need no downloads."""

from __future__ import annotations

import torch

TEXT = """\
Reinforcement learning from human feedback aligns a language model with what people prefer.
First the model is fine-tuned on demonstrations: a prompt and a good answer, learned token by
token. Then a reward model learns to score answers, trained on pairs where a person chose one
answer over another. Last, the policy generates answers, the reward model scores them, and
proximal policy optimisation moves the policy towards higher reward while a penalty keeps it
close to where it started, so it does not forget how to write.
Large models do not fit on one accelerator. Tensor parallelism splits each weight matrix
across devices of a node; pipeline parallelism splits the layers into stages that pass
activations along; data parallelism copies the whole arrangement and averages gradients.
A good trainer gives the same numbers whichever way the work is split.
"""


def byte_batches(*, seq: int, batch: int, steps: int, seed: int = 0) -> list[dict]:
    """Next-byte prediction batches drawn from TEXT (vocabulary: the 256 byte values)."""
    data = torch.tensor(list(TEXT.encode()), dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=g)
        window = torch.stack([data[s:s + seq + 1] for s in starts])
        out.append({
            "tokens": window[:, :-1].contiguous(),
            "labels": window[:, 1:].contiguous(),
            "loss_mask": torch.ones(batch, seq),
            "position_ids": torch.arange(seq).expand(batch, seq).contiguous(),
        })
    return out
