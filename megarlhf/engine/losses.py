"""Loss closures for `engine.schedule.forward_backward` (language modelling and friends)."""

from __future__ import annotations

import torch

from megarlhf.engine.schedule import Loss
from megarlhf.parallel.mesh import Mesh
from megarlhf.parallel.vocab import vocab_parallel_logprobs


def token_logprobs(logits_BTV: torch.Tensor, labels_BT: torch.Tensor, mesh: Mesh,
                   vocab_size: int) -> torch.Tensor:
    """log p(labels) from this TP rank's vocabulary slice of the (padded) logits."""
    return vocab_parallel_logprobs(
        logits_BTV, labels_BT, tp_group=mesh.tp_group,
        vocab_start=mesh.tp_rank * logits_BTV.shape[-1], vocab_size=vocab_size,
    )


def gather_logits(logits_BTV: torch.Tensor, mesh: Mesh, vocab_size: int) -> torch.Tensor:
    """Full-vocabulary logits [B, T, vocab_size] from this TP rank's slice (padding dropped).

    For checks and small batches only: the point of vocab-parallel losses is to avoid this.
    """
    parts = [torch.empty_like(logits_BTV) for _ in range(mesh.tp)]
    torch.distributed.all_gather(parts, logits_BTV.contiguous(), group=mesh.tp_group)
    return torch.cat(parts, dim=-1)[..., :vocab_size]


def lm_loss(mesh: Mesh, vocab_size: int) -> Loss:
    """Next-token cross entropy summed over `loss_mask` tokens (labels = tokens shifted left).

    The batch needs `labels` [B, T] and `loss_mask` [B, T]; the logits become log p(labels)
    per position first (so context parallelism gathers those, not the logits); returns the
    token sum so the schedule can normalise by the global token count.
    """

    def loss_fn(batch, logp_BT):
        mask_BT = batch["loss_mask"].float()
        loss_sum = -(logp_BT * mask_BT).sum()
        num_tokens = mask_BT.sum().to(torch.int)
        return loss_sum, num_tokens, {"loss_sum": loss_sum.detach().clone(),
                                      "num_tokens": num_tokens.detach().clone()}

    return Loss(closure=loss_fn, per_position=lambda inputs, logits_BTV: token_logprobs(
        logits_BTV, inputs["labels"], mesh, vocab_size))
