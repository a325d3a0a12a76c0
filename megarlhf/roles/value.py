"""Critic and reward model: a GPT trunk with a scalar head. The critic gives per-token values
and trains on the clipped value loss; the reward model scores a sequence at its last real
token."""

from __future__ import annotations

import dataclasses

import torch

from megarlhf.engine.train import StepMetrics, TrainEngine
from megarlhf.rl.losses import aggregate, value_loss
from megarlhf.engine.schedule import gather_rows
from megarlhf.roles.common import microbatches
from megarlhf.roles.sequences import SequenceBatch, shift_right


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

    def __init__(self, engine: TrainEngine, *, num_microbatches: int = 1,
                 loss: ValueLossConfig | None = None):
        if not engine.spec.value_head:
            raise ValueError("a value role needs a scalar head; build its engine with "
                             "model_spec(..., value_head=True)")
        self.engine, self.num_microbatches = engine, num_microbatches
        self.loss = loss or ValueLossConfig()

    def _forward(self, batch: SequenceBatch) -> list[dict]:
        def keep(mb, values_BT):
            values_BT = values_BT.float()
            last = values_BT[torch.arange(values_BT.shape[0]), mb["last_index"]]
            zero = torch.zeros((), device=values_BT.device)
            return zero, torch.ones((), dtype=torch.int), {
                "values": shift_right(values_BT).detach(), "score": last.detach()}

        return self.engine.forward(microbatches(self.engine, batch, self.num_microbatches),
                                   keep)

    def values(self, batch: SequenceBatch) -> torch.Tensor:
        """V(state before token t) [B, T] on every rank."""
        # [:, :T]: the micro-batches may be padded (sequence parallelism)
        return gather_rows(self._forward(batch), "values", self.engine.mesh)[:, :batch.shape[1]]

    def scores(self, batch: SequenceBatch) -> torch.Tensor:
        """The head's output at each row's last real token [B] (a reward model's score)."""
        return gather_rows(self._forward(batch), "score", self.engine.mesh)

    def train_step(self, batch: SequenceBatch, old_values: torch.Tensor,
                   returns: torch.Tensor) -> tuple[StepMetrics, dict[str, float]]:
        """One optimizer step of the (clipped) value loss; returns step metrics and the global
        mean value loss and value-clip fraction over response tokens."""
        cfg = self.loss

        def loss_fn(mb, values_BT):
            values = shift_right(values_BT.float())
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

        mbs = microbatches(self.engine, batch, self.num_microbatches,
                           response_mask=batch.response_mask.float(),
                           old_values=old_values.float(), returns=returns.float())
        step = self.engine.train_step(mbs, loss_fn)
        s = step.sums
        return step, {"value_loss": s["loss_sum"] / s["num_tokens"],
                      "value_clip_fraction": s["clipped"] / s["tokens"]}
