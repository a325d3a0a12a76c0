"""A trainable (or frozen) Megatron model on one mesh: chunks, DDP, optimizer, LR schedule.

The four PPO roles, SFT and RM all stand on this: `forward` for inference passes and
`train_step` for one optimizer step over a list of micro-batches with a loss closure.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads

from megarlhf.engine.optim import OptimConfig, build_optimizer, build_scheduler
from megarlhf.engine.moe_load import ExpertLoad
from megarlhf.engine.schedule import (
    Batch, Loss, LossFn, forward_backward, from_last_stage, outputs_from_last_stage,
)
from megarlhf.models.gpt import ModelSpec, build_model
from megarlhf.models.lora import start_dropout_step
from megarlhf.models.routing_replay import RoutingReplay
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
    moe_load: float | None = None
    """Mixture-of-experts models: the busiest EP rank's routed tokens over the mean, in the
    worst layer (engine/moe_load.py); None for a dense model."""


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
        self.expert_load = ExpertLoad(chunks, mesh, spec.model.num_experts) \
            if spec.model.is_moe and optim is not None else None
        self.routing_replay = RoutingReplay(chunks) if spec.model.is_moe else None
        """Replays the `routing` micro-batches carry (models/routing_replay.py)."""
        # Where the weights came from (architecture, HF config/tokenizer files), set by
        # load_checkpoint and written again by save_checkpoint so exports keep the source's
        # config and tokenizer.
        self.provenance: dict = {"architecture": None, "hf_files": {}}

    def forward(self, microbatches: list[Batch], loss_fn: LossFn | Loss) -> list[dict]:
        """Forward-only pass; the loss closures' dicts, on every pipeline stage."""
        for chunk in self.chunks:
            chunk.eval()
        with torch.no_grad():
            out = forward_backward(self.chunks, self.mesh, microbatches, loss_fn,
                                   forward_only=True, replay=self.routing_replay)
        return outputs_from_last_stage(out, self.mesh)

    def train_step(self, microbatches: list[Batch], loss_fn: LossFn | Loss, *,
                   before_step: Callable[[list[dict]], bool] | None = None) -> StepMetrics:
        """One optimizer step over `microbatches` (this DP rank's share of the global batch).

        `loss_fn` must return the loss as a token sum with its token count (see
        engine.schedule); the gradient is the token mean over the global batch.
        `before_step`: called on every rank after the backward pass with the loss closures'
        dicts (every stage's, as `forward` returns them); when it returns False the optimizer
        does not step (a guard that needs the pass's own outputs), and the step is `skipped`.
        It must answer alike on every rank.
        """
        if self.optimizer is None:
            raise ValueError("this engine was built without an optimizer (frozen role)")
        for chunk in self.chunks:
            chunk.train()
            chunk.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.expert_load is not None:
            self.expert_load.reset()
        if self.spec.lora is not None and self.spec.lora.dropout:
            # The step's dropout masks follow from the LoRA seed and the step number (also
            # on a resume).
            start_dropout_step(self.chunks, self.spec.lora.seed * 1_000_003
                               + self.scheduler.num_steps)
        out = forward_backward(self.chunks, self.mesh, microbatches, loss_fn,
                               forward_only=False, replay=self.routing_replay)
        if before_step is None or before_step(outputs_from_last_stage(out, self.mesh)):
            ok, grad_norm, _ = self.optimizer.step()
            self.scheduler.step(increment=1)
        else:  # the gradients are dropped by the next step's zeroing
            ok, grad_norm = False, None
        self._check_tied_copies()

        sums = self.global_sums(out)
        return StepMetrics(
            loss=sums["loss_sum"] / max(sums["num_tokens"], 1.0),
            num_tokens=int(sums["num_tokens"]),
            grad_norm=float(grad_norm) if grad_norm is not None else float("nan"),
            lr=self.optimizer.param_groups[0]["lr"],
            skipped=not ok,
            sums=sums,
            moe_load=self.expert_load.busiest_over_mean() if self.expert_load else None,
        )

    def _check_tied_copies(self) -> None:
        """With tied embeddings and PP > 1 Megatron keeps two copies of the embedding, on the
        first stage (input) and the last (output), kept equal only by updating both with the
        same all-reduced gradient. A drift would make the trainer's logits disagree with the
        embedding the rollout engines get (from the first stage), so compare a bitwise
        fingerprint of the two after every step, over the embedding group."""
        group = self.mesh.embedding_group
        if group is None or self.mesh.pp == 1 or not self.spec.model.tie_embeddings \
                or self.spec.value_head:
            return
        modules = self.unwrapped()
        module = modules[0] if self.mesh.is_first_stage else modules[-1]
        mine = bit_fingerprint(module.shared_embedding_or_output_weight())
        prints = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(prints, mine, group=group)
        if any(not torch.equal(p, prints[0]) for p in prints):
            raise RuntimeError("the tied embedding's copies on the first and last pipeline "
                               "stage differ after an optimizer step (their gradients were "
                               "not reduced together); logits and rollout weights would "
                               "disagree")

    def global_sums(self, out: list[dict]) -> dict[str, float]:
        """Every 0-dim entry of the loss closures' dicts summed over micro-batches and DP
        ranks, on every rank (closures report sums; callers divide)."""
        sums = None
        if self.mesh.is_last_stage:
            keys = sorted(k for k, v in out[0].items() if v.dim() == 0)
            sums = {}
            if keys:
                # On the entries' device: the DP all-reduce is NCCL's on a GPU.
                totals = torch.stack([torch.stack([d[k].double() for k in keys])
                                      for d in out]).sum(0)
                dist.all_reduce(totals, group=self.mesh.dp_group)
                sums = dict(zip(keys, totals.tolist()))
        return from_last_stage(sums, self.mesh)

    def unwrapped(self) -> list[torch.nn.Module]:
        """The GPT modules without the DDP wrapper."""
        return [getattr(c, "module", c) for c in self.chunks]

    def refresh_masters(self) -> None:
        """A 16-bit engine's optimizer holds fp32 master copies made when it was built: after
        weights are written outside load_checkpoint (which refreshes them itself, from an fp32
        checkpoint's own values), they must take the written values, or the first step writes
        the build-time ones back."""
        if self.optimizer is not None:
            self.optimizer.reload_model_params()


_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@torch.no_grad()
def bit_fingerprint(tensor: torch.Tensor, rows_per_block: int = 4096) -> torch.Tensor:
    """[2] int64 from the tensor's bit patterns: their sum and their row-weighted sum (wrapping
    on overflow). Equal tensors give equal fingerprints; a changed bit or a moved row changes
    them. Read in row blocks so the int64 copy stays small."""
    bits = tensor.detach().view(_INT_OF_WIDTH[tensor.element_size()])
    bits = bits.reshape(bits.shape[0], -1) if bits.dim() else bits.reshape(1, 1)
    out = torch.zeros(2, dtype=torch.int64, device=tensor.device)
    for start in range(0, bits.shape[0], rows_per_block):
        block = bits[start:start + rows_per_block].to(torch.int64)
        weights = torch.arange(start + 1, start + 1 + block.shape[0], dtype=torch.int64,
                               device=tensor.device).unsqueeze(1)
        out[0] += block.sum()
        out[1] += (block * weights).sum()
    return out
