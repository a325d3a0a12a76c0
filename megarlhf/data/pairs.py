"""Reward-model batches: the chosen and rejected sequence of each pair on adjacent rows.

Row 2i is pair i's chosen sequence, row 2i+1 its rejected one, so any even-sized contiguous
slice (a DP rank's share, a micro-batch) holds whole pairs. Rows are prompt + response,
right-padded: a reward model's score is read at the last real token, and it does not depend on
where the padding sits (RoPE is relative; tests/test_roles.py checks padded against unpadded).
"""

from __future__ import annotations

import torch

from megarlhf.data.encode import Example
from megarlhf.data.packing import sft_batch
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
    """`pair_batch` of the pairs' sequences laid out by `pair_sequences`, and per row
    `ref_logp` where the pairs carry reference logprobs."""
    margins = torch.tensor([ex.margin for ex in pairs], dtype=torch.float32)
    return {**batch.model_inputs(),
            "last_index": batch.attention_mask.long().cumsum(1).argmax(1),
            "margin": margins.repeat_interleave(2), "pair_weight": torch.ones(2 * len(pairs)),
            **({} if pairs[0].ref_logps is None else
               {"ref_logp": torch.tensor([lp for ex in pairs for lp in ex.ref_logps])})}


def pair_length(ex: Example) -> int:
    """Positions a pair takes packed: its prompt twice, once before each response."""
    return ex.length(0) + ex.length(1)


def packed_pair_batch(rows: list[list[Example]], pad_id: int) -> dict[str, torch.Tensor]:
    """Several pairs per row, in SFT's packed layout (data/packing.sft_batch: each sequence a
    document of its own, positions restarting): pair j of a row is its documents 2j (chosen)
    and 2j+1 (rejected). `label_mask` [B, T] marks the positions whose label is a response
    token of the same document; `pair_weight` [B, D] (D: twice the most pairs in a row) is 1
    where the document exists, and `ref_logp` [B, D] likewise where the pairs carry reference
    logprobs."""
    batch = sft_batch([[Example(prompt=ex.prompt, responses=(r,)) for ex in row
                        for r in ex.responses] for row in rows], pad_id)
    batch["label_mask"] = batch.pop("loss_mask")
    weight = torch.zeros(len(rows), 2 * max(len(row) for row in rows))
    for b, row in enumerate(rows):
        weight[b, :2 * len(row)] = 1.0
    batch["pair_weight"] = weight
    if rows[0][0].ref_logps is not None:
        ref = torch.zeros_like(weight)
        for b, row in enumerate(rows):
            ref[b, :2 * len(row)] = torch.tensor([lp for ex in row for lp in ex.ref_logps])
        batch["ref_logp"] = ref
    return batch
