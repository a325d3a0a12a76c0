"""Exponential moving average of parameters (DeepSpeed-Chat's actor EMA).

Each rank updates the shards it holds: under TP/PP the EMA tensors are sharded like the
parameters they follow, so no communication is needed.
"""

from __future__ import annotations

from typing import Iterable

import torch


@torch.no_grad()
def ema_update(ema_params: Iterable[torch.Tensor], params: Iterable[torch.Tensor],
               beta: float) -> None:
    """In place, for each pair: ema = beta * ema + (1 - beta) * p.

    beta in [0, 1]: 1 keeps the EMA, 0 copies the parameters. The EMA may be kept in a wider
    dtype than the parameters (fp32 EMA of bf16 weights); p is cast to the EMA's dtype.
    """
    if not 0.0 <= beta <= 1.0:
        raise ValueError(f"EMA beta must be in [0, 1], got {beta}")
    ema_params, params = list(ema_params), list(params)
    if len(ema_params) != len(params):
        raise ValueError(f"{len(ema_params)} EMA tensors for {len(params)} parameters")
    for i, (ema, p) in enumerate(zip(ema_params, params)):
        if ema.shape != p.shape:
            raise ValueError(f"tensor {i}: EMA shape {tuple(ema.shape)} != parameter shape "
                             f"{tuple(p.shape)}")
        # lerp: ema + (1 - beta) * (p - ema), exact at both ends of [0, 1].
        ema.lerp_(p.to(ema.dtype), 1.0 - beta)
