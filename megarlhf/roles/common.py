"""What both role kinds share: cutting a global batch into this rank's micro-batches and
putting per-token results back together as the global batch on every rank."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megarlhf.engine.schedule import rank_microbatches
from megarlhf.engine.train import TrainEngine
from megarlhf.roles.sequences import SequenceBatch


def microbatches(engine: TrainEngine, batch: SequenceBatch, num_microbatches: int,
                 **per_token: torch.Tensor) -> list[dict]:
    batch.check_length(engine.spec.model.max_position_embeddings)
    for name, value in per_token.items():
        if tuple(value.shape) != batch.shape:
            raise ValueError(f"{name} has shape {tuple(value.shape)}, the batch is "
                             f"{batch.shape}")
    return rank_microbatches(batch.model_inputs(**per_token), engine.mesh, num_microbatches)


def gather_rows(engine: TrainEngine, out: list[dict], key: str) -> torch.Tensor:
    """Concatenate `key` over this rank's micro-batches, then over DP ranks: the global rows."""
    local = torch.cat([d[key] for d in out])
    parts = [torch.empty_like(local) for _ in range(engine.mesh.dp_size)]
    dist.all_gather(parts, local.contiguous(), group=engine.mesh.dp_group)
    return torch.cat(parts)
