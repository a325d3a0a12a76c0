"""What a weight update must bring: every HF tensor of the model once, with its shape.

Both engines check a WeightStream with this, so a stream from another model or a broken
producer fails with the same message whichever engine reads it.
"""

from __future__ import annotations

import torch

class WeightCheck:
    """One update's bookkeeping; `model` describes the receiving model in errors."""

    def __init__(self, expected: dict[str, tuple[int, ...]], model: str):
        self.expected, self.model = expected, model
        self.arrived: set[str] = set()

    def accept(self, name: str, tensor: torch.Tensor) -> None:
        shape = self.expected.get(name)
        if shape is None:
            raise ValueError(f"unknown weight {name!r}: not a parameter of {self.model}")
        if name in self.arrived:
            raise ValueError(f"weight {name!r} arrived twice in one update")
        if tuple(tensor.shape) != shape:
            raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, the model "
                             f"needs {shape}")
        self.arrived.add(name)

    def finish(self) -> None:
        """Raise unless every expected tensor arrived."""
        missing = sorted(set(self.expected) - self.arrived)
        if missing:
            shown = ", ".join(missing[:8]) + (", ..." if len(missing) > 8 else "")
            raise ValueError(f"{len(missing)} weight(s) never arrived: {shown}")
