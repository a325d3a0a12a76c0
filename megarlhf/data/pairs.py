"""Reward-model batches: the chosen and rejected sequence of each pair on adjacent rows.

Row 2i is pair i's chosen sequence, row 2i+1 its rejected one, so any even-sized contiguous
slice (a DP rank's share, a micro-batch) holds whole pairs. Rows are prompt + response,
right-padded: a reward model's score is read at the last real token, and it does not depend on
where the padding sits (RoPE is relative; tests/test_roles.py checks padded against unpadded).
"""

from __future__ import annotations

import torch

from megarlhf.data.encode import Example
from megarlhf.data.sequences import SequenceBatch


def pair_sequences(pairs: list[Example], pad_id: int) -> SequenceBatch:
    if any(len(ex.responses) != 2 for ex in pairs):
        raise ValueError("pair batches need examples with exactly two responses")
    return row_sequences([(ex.prompt, resp) for ex in pairs for resp in ex.responses], pad_id)


def row_sequences(rows: list[tuple[tuple[int, ...], tuple[int, ...]]],
                  pad_id: int) -> SequenceBatch:
    """(prompt, response) rows, right-padded to the longest, with their response mask."""
    T = max(len(p) + len(r) for p, r in rows)
    tokens = torch.full((len(rows), T), pad_id, dtype=torch.long)
    attention = torch.zeros(len(rows), T, dtype=torch.long)
    response = torch.zeros(len(rows), T, dtype=torch.long)
    for i, (prompt, resp) in enumerate(rows):
        n = len(prompt) + len(resp)
        tokens[i, :n] = torch.tensor(prompt + resp)
        attention[i, :n] = 1
        response[i, len(prompt):n] = 1
    return SequenceBatch(tokens=tokens, attention_mask=attention, response_mask=response)


def pair_batch(pairs: list[Example], pad_id: int) -> dict[str, torch.Tensor]:
    """The engine's micro-batch dict: model inputs, `last_index` of each row, and per-row
    `margin` and `pair_weight` (1; 0 marks filler pairs that must not count)."""
    return pair_inputs(pairs, pair_sequences(pairs, pad_id))


def pair_inputs(pairs: list[Example], batch: SequenceBatch) -> dict[str, torch.Tensor]:
    """`pair_batch` of the pairs' sequences laid out by `pair_sequences`."""
    margins = torch.tensor([ex.margin for ex in pairs], dtype=torch.float32)
    return {**batch.model_inputs(),
            "last_index": batch.attention_mask.long().cumsum(1).argmax(1),
            "margin": margins.repeat_interleave(2), "pair_weight": torch.ones(2 * len(pairs))}


def pair_length(ex: Example) -> int:
    """Positions a pair takes packed: its prompt twice, once before each response."""
    return ex.length(0) + ex.length(1)


def packed_pair_batch(rows: list[list[Example]], pad_id: int) -> dict[str, torch.Tensor]:
    """Several pairs per row (data/packing.py's layout: each sequence a document of its own,
    positions restarting): pair j of a row is its documents 2j (chosen) and 2j+1 (rejected).
    Per row and document D (twice the most pairs in a row): `pair_weight` [B, D] (1 where the
    document exists); `label_mask` [B, T] marks the positions whose label is a response token
    of the same document."""
    T = max(sum(pair_length(ex) for ex in row) for row in rows)
    B, D = len(rows), 2 * max(len(row) for row in rows)
    tokens = torch.full((B, T), pad_id, dtype=torch.long)
    labels = torch.zeros(B, T, dtype=torch.long)
    label_mask = torch.zeros(B, T)
    positions = torch.zeros(B, T, dtype=torch.long)
    doc = -torch.arange(1, T + 1).repeat(B, 1)  # padding: an id of its own per position
    weight = torch.zeros(B, D)
    for b, row in enumerate(rows):
        start = 0
        for d, (prompt, resp) in enumerate((ex.prompt, r) for ex in row for r in ex.responses):
            ids = torch.tensor(prompt + resp)
            end = start + len(ids)
            tokens[b, start:end] = ids
            labels[b, start:end - 1] = ids[1:]
            label_mask[b, start + len(prompt) - 1:end - 1] = 1.0
            positions[b, start:end] = torch.arange(len(ids))
            doc[b, start:end] = d
            weight[b, d] = 1.0
            start = end
    return {"tokens": tokens, "labels": labels, "position_ids": positions,
            "document_ids": doc, "label_mask": label_mask, "pair_weight": weight}
