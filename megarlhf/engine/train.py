"""A trainable (or frozen) Megatron model on one mesh: chunks, DDP, optimizer, LR schedule.

The four PPO roles, SFT and RM all stand on this: `forward` for inference passes and
`train_step` for one optimizer step over a list of micro-batches with a loss closure.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads

from megarlhf.engine.optim import OptimConfig, build_optimizer, build_scheduler
from megarlhf.engine.schedule import (
    Batch, LossFn, forward_backward, from_last_stage, outputs_from_last_stage,
)
from megarlhf.models.gpt import ModelSpec, build_model
from megarlhf.parallel.mesh import Mesh


@dataclasses.dataclass(frozen=True)
class StepMetrics:
    loss: float
    """Token-mean loss over the global batch (all micro-batches, all DP ranks)."""
    num_tokens: int
    grad_norm: float
    lr: float
    skipped: bool
    """True when the optimizer skipped the update (non-finite gradients)."""
    sums: dict[str, float] = dataclasses.field(default_factory=dict)
    """The loss closure's scalar metrics summed over the global batch."""


class TrainEngine:
    def __init__(self, spec: ModelSpec, mesh: Mesh, optim: OptimConfig | None = None):
        """Build this rank's chunks; with `optim` they are DDP-wrapped with an optimizer."""
        self.spec, self.mesh, self.optim_config = spec, mesh, optim
        self.dtype = spec.transformer.params_dtype
        chunks = build_model(spec, mesh)
        self.optimizer = self.scheduler = None
        if optim is not None:
            ddp_config = DistributedDataParallelConfig(
                grad_reduce_in_fp32=True,
                overlap_grad_reduce=False,
                use_distributed_optimizer=optim.use_distributed_optimizer,
            )
            chunks = [
                DistributedDataParallel(
                    config=spec.transformer, ddp_config=ddp_config, module=chunk,
                    # Bucketing serves overlap; chunks after the first must not bucket.
                    disable_bucketing=i > 0,
                )
                for i, chunk in enumerate(chunks)
            ]
            self.optimizer = build_optimizer(optim, chunks, dtype=self.dtype)
            self.scheduler = build_scheduler(optim, self.optimizer)
            # The schedules call these hooks; megatron-core leaves wiring them to the trainer.
            config = spec.transformer
            config.finalize_model_grads_func = finalize_model_grads
            config.grad_scale_func = self.optimizer.scale_loss
            config.no_sync_func = [c.no_sync for c in chunks] if len(chunks) > 1 \
                else chunks[0].no_sync
        self.chunks = chunks
        # Where the weights came from (architecture, HF config/tokenizer files), set by
        # load_checkpoint and written again by save_checkpoint so exports keep the source's
        # config and tokenizer.
        self.provenance: dict = {"architecture": None, "hf_files": {}}

    def forward(self, microbatches: list[Batch], loss_fn: LossFn) -> list[dict]:
        """Forward-only pass; the loss closures' dicts, on every pipeline stage."""
        for chunk in self.chunks:
            chunk.eval()
        with torch.no_grad():
            out = forward_backward(self.chunks, self.mesh, microbatches, loss_fn,
                                   forward_only=True)
        return outputs_from_last_stage(out, self.mesh)

    def train_step(self, microbatches: list[Batch], loss_fn: LossFn) -> StepMetrics:
        """One optimizer step over `microbatches` (this DP rank's share of the global batch).

        `loss_fn` must return the loss as a token sum with its token count (see
        engine.schedule); the gradient is the token mean over the global batch.
        """
        if self.optimizer is None:
            raise ValueError("this engine was built without an optimizer (frozen role)")
        for chunk in self.chunks:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        out = forward_backward(self.chunks, self.mesh, microbatches, loss_fn, forward_only=False)
        ok, grad_norm, _ = self.optimizer.step()
        self.scheduler.step(increment=1)

        sums = self.global_sums(out)
        return StepMetrics(
            loss=sums["loss_sum"] / max(sums["num_tokens"], 1.0),
            num_tokens=int(sums["num_tokens"]),
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            lr=self.optimizer.param_groups[0]["lr"],
            skipped=not ok,
            sums=sums,
        )

    def global_sums(self, out: list[dict]) -> dict[str, float]:
        """Every 0-dim entry of the loss closures' dicts summed over micro-batches and DP
        ranks, on every rank (closures report sums; callers divide)."""
        sums = None
        if self.mesh.is_last_stage:
            keys = sorted(k for k, v in out[0].items() if v.dim() == 0)
            totals = torch.zeros(len(keys), dtype=torch.float64)
            for d in out:
                totals += torch.stack([d[k].double() for k in keys])
            dist.all_reduce(totals, group=self.mesh.dp_group)
            sums = dict(zip(keys, totals.tolist()))
        return from_last_stage(sums, self.mesh)

    def unwrapped(self) -> list[torch.nn.Module]:
        """The GPT modules without the DDP wrapper."""
        return [getattr(c, "module", c) for c in self.chunks]


