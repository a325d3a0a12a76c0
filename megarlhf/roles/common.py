"""What both role kinds share: cutting a global batch into this rank's micro-batches."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megarlhf.engine.schedule import rank_microbatches
from megarlhf.engine.train import TrainEngine
from megarlhf.roles.sequences import SequenceBatch


def sequence_multiple(engine: TrainEngine) -> int:
    """What a micro-batch's sequence length must be a multiple of: TP under sequence
    parallelism (megatron-core splits the sequence dimension over the TP ranks), else 1."""
    config = engine.spec.transformer
    return config.tensor_model_parallel_size if config.sequence_parallel else 1


def microbatches(engine: TrainEngine, batch: SequenceBatch, num_microbatches: int,
                 **per_token: torch.Tensor) -> list[dict]:
    """This rank's micro-batches of `batch` with `per_token` tensors [B, T] added. Under
    sequence parallelism the columns are padded on the right to a multiple of TP: padding
    tokens (attention_mask 0, response_mask 0, per-token tensors 0) that no real token attends
    to and no loss or metric counts; per-token outputs come back that much longer, and the
    roles cut them to T."""
    batch.check_length(engine.spec.model.max_position_embeddings)
    for name, value in per_token.items():
        if tuple(value.shape) != batch.shape:
            raise ValueError(f"{name} has shape {tuple(value.shape)}, the batch is "
                             f"{batch.shape}")
    pad = -batch.shape[1] % sequence_multiple(engine)
    if pad:
        batch = batch.right_padded(pad)
        per_token = {name: F.pad(value, (0, pad)) for name, value in per_token.items()}
    return rank_microbatches(batch.model_inputs(**per_token), engine.mesh, num_microbatches)
