"""What both role kinds share: cutting a global batch into this rank's micro-batches."""

from __future__ import annotations

import torch

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
