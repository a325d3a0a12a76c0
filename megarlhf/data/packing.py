"""SFT rows: one prompt + response document per row, or several packed into one row.

Legend: B rows, T positions. In a packed row each token sees only earlier tokens of its own
document, and positions restart at 0 for every document, so a document's loss is the same
packed or alone: the rows carry document ids, and the model runs them in the packed THD
layout (models/packed.py), or under context parallelism with `document_mask`. Padding
positions see only padding (no softmax row is empty). Loss falls on response tokens only:
`loss_mask` marks the positions whose label (the next token of the same document) is a
response token.
"""

from __future__ import annotations

import bisect
from typing import Callable

import torch

from megarlhf.data.encode import Example


def pack(examples: list[Example], row_length: int,
         length: Callable[[Example], int] = Example.length) -> list[list[Example]]:
    """Best-fit packing in the given order: each example (`length(ex)` positions: an SFT
    document; a DPO pair's two sequences) goes into the open row with the least room that
    still holds it, or starts a new row."""
    rows: list[list[Example]] = []
    room: list[tuple[int, int]] = []  # (free positions, row index), sorted
    for ex in examples:
        n = length(ex)
        if n > row_length:
            raise ValueError(f"a document of {n} tokens does not fit rows of {row_length}")
        i = bisect.bisect_left(room, (n, -1))
        if i < len(room):
            free, r = room.pop(i)
        else:
            free, r = row_length, len(rows)
            rows.append([])
        rows[r].append(ex)
        if free - n > 0:
            bisect.insort(room, (free - n, r))
    return rows


def one_per_row(examples: list[Example]) -> list[list[Example]]:
    return [[ex] for ex in examples]


def sft_batch(rows: list[list[Example]], pad_id: int) -> dict[str, torch.Tensor]:
    """The engine's micro-batch dict for `rows`, T = the longest row."""
    T = max(sum(ex.length() for ex in row) for row in rows)
    B = len(rows)
    tokens = torch.full((B, T), pad_id, dtype=torch.long)
    labels = torch.zeros(B, T, dtype=torch.long)
    loss_mask = torch.zeros(B, T)
    positions = torch.zeros(B, T, dtype=torch.long)
    # Padding gets a distinct negative document id per position: it matches only itself.
    doc = -torch.arange(1, T + 1).repeat(B, 1)
    for b, row in enumerate(rows):
        start = 0
        for d, ex in enumerate(row):
            ids = torch.tensor(ex.prompt + ex.responses[0])
            n, p = len(ids), len(ex.prompt)
            end = start + n
            tokens[b, start:end] = ids
            labels[b, start:end - 1] = ids[1:]
            loss_mask[b, start + p - 1:end - 1] = 1.0
            positions[b, start:end] = torch.arange(n)
            doc[b, start:end] = d
            start = end
    return {"tokens": tokens, "labels": labels, "loss_mask": loss_mask,
            "position_ids": positions, "document_ids": doc}


def document_mask(doc: torch.Tensor, rows: torch.Tensor | None = None,
                  shared: torch.Tensor | None = None) -> torch.Tensor:
    """[B, 1, Q, T] bool, True = masked, from document ids [B, T]: causal within a document,
    nothing across, for the query positions `rows` [Q] (all T when None). Give padding
    positions distinct ids of their own (no softmax row is then empty). Positions marked in
    `shared` [B, T] (a prompt several sequences of the row continue, roles/batching.py) are
    keys of every later position of their row.

    Batches carry the ids [B, T] and the mask is made where the model runs (engine/schedule.py):
    the mask grows with T^2, the ids with T."""
    T = doc.shape[1]
    keys = torch.arange(T, device=doc.device)
    rows = keys if rows is None else rows
    causal = rows[:, None] >= keys[None, :]
    seen = doc[:, rows, None] == doc[:, None, :]
    if shared is not None:
        seen = seen | shared[:, None, :]
    return ~(seen & causal)[:, None]
