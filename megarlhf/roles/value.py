"""Critic and reward model: a GPT trunk with a scalar head. The critic gives per-token values
and trains on the clipped value loss; the reward model scores a sequence at its last real
token."""

from __future__ import annotations

import dataclasses

import torch

from megarlhf.data.sequences import SequenceBatch
from megarlhf.engine.train import StepMetrics, TrainEngine
from megarlhf.rl.losses import aggregate, value_loss
from megarlhf.roles.batching import Batching, about_token, at_last_token, microbatches, to_global


@dataclasses.dataclass(frozen=True, kw_only=True)
class ValueLossConfig:
    clip_eps: float | None = 0.2
    """Clip range of the new values around the old ones; None = unclipped."""
    aggregation: str = "token_mean"
    aggregation_norm: float | None = None
    """seq_mean_token_sum_norm's constant (megarlhf.rl.losses.aggregate)."""

    def __post_init__(self):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1), self.aggregation,
                  norm=self.aggregation_norm)  # the mode, and its norm


class ValueRole:
    """Critic (with an optimizer) or reward model (without) over one TrainEngine."""

    def __init__(self, engine: TrainEngine, *, batching: Batching = Batching(),
                 loss: ValueLossConfig | None = None):
        if not engine.spec.value_head:
            raise ValueError("a value role needs a scalar head; build its engine with "
                             "model_spec(..., value_head=True)")
        self.engine, self.batching = engine, batching
        self.loss = loss or ValueLossConfig()

    def _forward(self, batch: SequenceBatch, key: str, shape: tuple[int, ...]) -> torch.Tensor:
        # The head's outputs [R, L] in the micro-batch's layout (batching.py).
        def keep(mb, values_RL):
            values_RL = values_RL.float()
            zero = torch.zeros((), device=values_RL.device)
            return zero, torch.ones((), dtype=torch.int), {
                "values": about_token(mb, values_RL).detach(),
                "score": at_last_token(mb, values_RL).detach()}

        mbs = microbatches(self.engine, self.batching, batch)
        return to_global(mbs, self.engine.forward(mbs, keep), key, shape, self.engine)

    def values(self, batch: SequenceBatch) -> torch.Tensor:
        """V(state before token t) [B, T] on every rank."""
        return self._forward(batch, "values", batch.shape)

    def scores(self, batch: SequenceBatch) -> torch.Tensor:
        """The head's output at each row's last real token [B] (a reward model's score)."""
        return self._forward(batch, "score", batch.shape[:1])

    def train_step(self, batch: SequenceBatch, old_values: torch.Tensor,
                   returns: torch.Tensor, *, loss_mask: torch.Tensor | None = None
                   ) -> tuple[StepMetrics, dict[str, float]]:
        """One optimizer step of the (clipped) value loss; returns step metrics and the global
        mean value loss and value-clip fraction over response tokens. `loss_mask` [B, T]: the
        response tokens with a value target (None: all; a failed sample has none)."""
        cfg = self.loss

        def loss_fn(mb, values_RL):
            values = about_token(mb, values_RL.float())
            mask = mb["response_mask"]
            loss_BT = value_loss(values, mb["old_values"], mb["returns"], mask,
                                 clip_eps=cfg.clip_eps)
            num, den = aggregate(loss_BT, mask, cfg.aggregation, norm=cfg.aggregation_norm)
            m = mask.bool()
            clipped = torch.zeros((), device=values.device)
            if cfg.clip_eps is not None:
                clipped = ((values - mb["old_values"]).abs() > cfg.clip_eps)[m].sum()
            return num, den.to(torch.int), {"loss_sum": num.detach().clone(),
                                            "num_tokens": den.detach().clone(),
                                            "tokens": m.sum(), "clipped": clipped}

        mbs = microbatches(self.engine, self.batching, batch,
                           response_mask=(batch.response_mask if loss_mask is None
                                          else loss_mask).float(),
                           old_values=old_values.float(), returns=returns.float())
        step = self.engine.train_step(mbs, loss_fn)
        s = step.sums
        return step, {"value_loss": s["loss_sum"] / s["num_tokens"],
                      "value_clip_fraction": s["clipped"] / s["tokens"]}
