"""Optimizer and learning-rate schedule configuration, and their megatron-core objects."""

from __future__ import annotations

import dataclasses
import math

import torch
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

LR_DECAY_STYLES = ("constant", "linear", "cosine")


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimConfig:
    lr: float = 1e-5
    """Peak learning rate."""
    min_lr: float = 0.0
    """Learning rate at the end of the decay."""
    weight_decay: float = 0.0
    """Adam's decoupled weight decay (AdamW)."""
    adam_beta1: float = 0.9
    """Adam's first-moment decay."""
    adam_beta2: float = 0.95
    """Adam's second-moment decay."""
    adam_eps: float = 1e-8
    """Adam's epsilon."""
    clip_grad: float = 1.0
    """Global gradient-norm clip (0 disables clipping)."""
    warmup_steps: int = 0
    """Steps of linear warm-up from 0 to lr."""
    decay_steps: int | None = None
    """Steps from the start to the end of the decay; None keeps the peak LR after warm-up."""
    lr_decay_style: str = "cosine"
    """How the learning rate falls from lr to min_lr over decay_steps: cosine, linear
    or constant."""
    use_distributed_optimizer: bool = True
    """Shard optimizer states (and the fp32 master weights) across data-parallel ranks."""

    def __post_init__(self):
        for name in ("lr", "min_lr", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps",
                     "clip_grad"):
            if not math.isfinite(getattr(self, name)):
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.adam_eps <= 0 or self.weight_decay < 0:
            raise ValueError(f"need adam_eps > 0 and weight_decay >= 0, got adam_eps="
                             f"{self.adam_eps}, weight_decay={self.weight_decay}")
        if self.lr <= 0 or self.min_lr < 0 or self.min_lr > self.lr:
            raise ValueError(f"need 0 <= min_lr <= lr and lr > 0, got lr={self.lr}, "
                             f"min_lr={self.min_lr}")
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ValueError(f"lr_decay_style {self.lr_decay_style!r} is not one of "
                             f"{LR_DECAY_STYLES}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.decay_steps is not None and self.decay_steps <= self.warmup_steps:
            raise ValueError(f"decay_steps ({self.decay_steps}) must exceed warmup_steps "
                             f"({self.warmup_steps})")
        if self.clip_grad < 0:
            raise ValueError(f"clip_grad must be >= 0, got {self.clip_grad}")


def build_optimizer(cfg: OptimConfig, chunks, *, dtype: torch.dtype):
    """Adam over the DDP-wrapped chunks, with fp32 master weights when training in 16 bit."""
    return get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=cfg.lr,
            min_lr=cfg.min_lr,
            weight_decay=cfg.weight_decay,
            adam_beta1=cfg.adam_beta1,
            adam_beta2=cfg.adam_beta2,
            adam_eps=cfg.adam_eps,
            clip_grad=cfg.clip_grad,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            # fp16's dynamic loss scale starts here. megatron-core's default, 2**32, overflows
            # and skips the first ~60 updates while it halves (hysteresis 2): a short RL run
            # would learn nothing. 2**16 is DeepSpeed's default start.
            initial_loss_scale=2.0**16,
            params_dtype=dtype,
            use_distributed_optimizer=cfg.use_distributed_optimizer,
        ),
        chunks,
    )


def build_scheduler(cfg: OptimConfig, optimizer) -> OptimizerParamScheduler:
    """LR schedule stepped once per optimizer step."""
    constant = cfg.decay_steps is None or cfg.lr_decay_style == "constant"
    return OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if cfg.warmup_steps else cfg.lr,
        max_lr=cfg.lr,
        min_lr=cfg.min_lr,
        lr_warmup_steps=cfg.warmup_steps,
        # megatron-core needs decay steps > warm-up even for a constant schedule.
        lr_decay_steps=cfg.decay_steps or cfg.warmup_steps + 1,
        lr_decay_style="constant" if constant else cfg.lr_decay_style,
        start_wd=cfg.weight_decay,
        end_wd=cfg.weight_decay,
        wd_incr_steps=1,
        wd_incr_style="constant",
    )
