"""Deterministic order: the eval hold-out and the rows of every epoch follow from one seed, so
every rank builds the same global batches and a resumed run continues the same sequence."""

from __future__ import annotations

import math
import random
from typing import Callable, Sequence, TypeVar

T = TypeVar("T")
R = TypeVar("R")


def shuffled(items: Sequence[T], seed: int) -> list[T]:
    out = list(items)
    random.Random(seed).shuffle(out)
    return out


def split_eval(items: Sequence[T], fraction: float, seed: int) -> tuple[list[T], list[T]]:
    """(train, eval): a seeded `fraction` of `items` held out (at least one if fraction > 0)."""
    if fraction <= 0:
        return list(items), []
    order = shuffled(range(len(items)), seed)
    n_eval = max(1, math.floor(fraction * len(items)))
    if n_eval >= len(items):
        raise ValueError(f"eval_fraction={fraction} of {len(items)} records leaves none for "
                         f"training")
    held = set(order[:n_eval])
    return ([x for i, x in enumerate(items) if i not in held],
            [items[i] for i in sorted(held)])


class EpochStream:
    """The rows of epoch 0, 1, 2, ... laid end to end; epoch e arranges `items` shuffled with
    seed (seed, e). `arrange` turns the shuffled items into rows (identity, or packing)."""

    def __init__(self, items: Sequence[T], *, seed: int,
                 arrange: Callable[[list[T]], list[R]] = list):
        if not items:
            raise ValueError("no training examples left to stream")
        self.items, self.seed, self.arrange = list(items), seed, arrange
        self._epochs: dict[int, list[R]] = {}

    def epoch(self, e: int) -> list[R]:
        if e not in self._epochs:
            # Only the epochs around the read position are kept.
            for old in [k for k in self._epochs if k < e - 1]:
                del self._epochs[old]
            self._epochs[e] = self.arrange(shuffled(self.items, self.seed * 1_000_003 + e))
        return self._epochs[e]

    def take(self, start: int, count: int) -> tuple[list[R], float]:
        """Rows [start, start + count) and the fractional epoch at their end."""
        e, offset = 0, 0
        while offset + len(self.epoch(e)) <= start:
            offset += len(self.epoch(e))
            e += 1
        rows = []
        while len(rows) < count:
            rows.extend(self.epoch(e)[start + len(rows) - offset:][:count - len(rows)])
            if len(rows) < count:
                offset += len(self.epoch(e))
                e += 1
        position = start + count - offset
        return rows, e + position / len(self.epoch(e))
