"""Stage 1: supervised fine-tuning on prompt + response pairs, loss on response tokens only."""

from __future__ import annotations

import functools

from megarlhf.data.packing import one_per_row, pack, sft_batch
from megarlhf.engine.losses import lm_loss
from megarlhf.sft import loop
from megarlhf.sft.config import SFTConfig


def sft_metrics(sums: dict[str, float]) -> dict[str, float]:
    return {"loss": sums["loss_sum"] / max(sums["num_tokens"], 1.0),
            "tokens": int(sums["num_tokens"])}


def sft_stage(cfg: SFTConfig, pad_id: int) -> loop.Stage:
    arrange = functools.partial(pack, row_length=cfg.data.max_length) if cfg.pack \
        else one_per_row
    return loop.Stage(
        name="sft", kind="sft", value_head=False, rows_per_item=1,
        row_tokens=cfg.data.max_length, arrange=arrange,
        to_batch=functools.partial(sft_batch, pad_id=pad_id), filler_key="loss_mask",
        loss_fn=lambda mesh, model: lm_loss(mesh, model.vocab_size), metrics=sft_metrics)


def run_sft(cfg: SFTConfig) -> dict:
    """Run SFT on this rank (call on every rank: torchrun, srun, or launch_local)."""
    return loop.run(cfg, functools.partial(sft_stage, cfg))
