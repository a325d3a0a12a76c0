"""Which device and process-group backend a rank computes with."""

from __future__ import annotations

import torch


def accelerator_available() -> bool:
    return torch.cuda.is_available()


def default_device() -> torch.device:
    """The device this rank computes on: its local GPU, or the CPU."""
    if accelerator_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def default_backend() -> str:
    return "nccl" if accelerator_available() else "gloo"
