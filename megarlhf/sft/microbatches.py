"""This DP rank's micro-batches of a stage's global batch (SFT, RM, DPO).

- by count (train.micro_batch_size): the rank's contiguous share of the rows, cut into equal
  micro-batches, each the batch's full width (padded to the layout's multiple);
- by token budget (train.max_tokens_per_micro_batch): the batch's items (`rows_per_item`
  adjacent rows: a pair's chosen and rejected rows stay together) spread over the DP ranks
  by their padded tokens, longest first, each to the rank holding the fewest so far; then
  each rank's items into micro-batches of at most the budget, counted as rows x the
  micro-batch's width (first fit, longest first: roles/batching.balance and fit, as PPO's
  budget). Each micro-batch is cut to the columns its rows use, so short rows make short
  micro-batches. Ranks may then run different numbers of micro-batches of different shapes:
  megatron-core's schedules meet across DP only when the gradients are reduced, and
  engine/schedule.py sends each shape along the pipeline. The losses are sums over pairs,
  rows or tokens divided by the global count, so for dense models without dropout the grouping
changes only summation order (an MoE load-balancing loss and LoRA dropout masks are per
micro-batch). Layouts where a micro-batch's forward meets other DP ranks (expert groups
spanning them) or whose schedule needs a count (virtual pipeline) are refused (loop.py).

A stage's rows are right-padded: real tokens from column 0, a row's padding positions have
negative document ids. A batch may hold a second set of rows under a prefix (KTO's `kl_*`,
another width): its per-token tensors are cut to their own widths, and an item's length is
its longest row of either set.
"""

from __future__ import annotations

import dataclasses

import torch

from megarlhf.engine.schedule import Batch, pad_to_multiple, rank_rows
from megarlhf.roles.batching import Span, balance, fit, padded_cost

DOCUMENT_IDS = "document_ids"


@dataclasses.dataclass(frozen=True)
class Split:
    dp_size: int
    dp_rank: int
    rows_per_item: int
    """Adjacent rows that stay in one micro-batch: 1 (a sequence), 2 (a pair)."""
    multiple: int
    """What a micro-batch's width must be a multiple of (ParallelConfig.sequence_multiple)."""
    num_microbatches: int = 1
    """Micro-batches per DP rank (count mode)."""
    max_tokens: int | None = None
    """Token budget of a micro-batch (replaces num_microbatches)."""

    def __call__(self, batch: Batch) -> list[Batch]:
        return [mb for _, mb in self.with_rows(batch)]

    def with_rows(self, batch: Batch) -> list[tuple[torch.Tensor, Batch]]:
        """This rank's micro-batches, each with the global batch's rows it holds."""
        if self.max_tokens is None:
            batch = pad_to_multiple(batch, self.multiple)
            return [(torch.arange(r.start, r.stop), {k: v[r.start:r.stop]
                                                     for k, v in batch.items()})
                    for r in rank_rows(batch["tokens"].shape[0], self.dp_size, self.dp_rank,
                                       self.num_microbatches)]
        ends = _row_ends(batch)
        n = self.rows_per_item
        rows = batch["tokens"].shape[0]
        if rows % n:
            raise ValueError(f"a batch of {rows} rows is not whole items of {n} rows")
        longest_row = torch.stack(list(ends.values())).amax(0)
        length = longest_row.view(-1, n).amax(1)  # per item
        # Spans count items, each n rows of the span's width.
        cost = lambda span: n * padded_cost(span, self.multiple)  # noqa: E731
        item_cost = torch.tensor([cost(Span.of(0, int(e))) for e in length])
        worst = int(item_cost.argmax())  # every rank checks it, so all raise alike
        if item_cost[worst] > self.max_tokens:
            raise ValueError(
                f"train.max_tokens_per_micro_batch={self.max_tokens} cannot hold an item of "
                f"{n} row(s) of {int(length[worst])} tokens ({int(item_cost[worst])} padded "
                f"to a multiple of {self.multiple}); raise it to at least that")
        mine = balance(item_cost, self.dp_size)[self.dp_rank]
        zeros = torch.zeros_like(length)
        out = []
        for items in fit(mine, zeros, length, self.max_tokens, cost):
            index = torch.tensor([i * n + j for i in items for j in range(n)])
            out.append((index, self._cut(batch, index, ends)))
        return out

    def _cut(self, batch: Batch, index: torch.Tensor, ends: dict[str, torch.Tensor]) -> Batch:
        """The rows `index` of `batch`, each row set's per-token tensors cut to the columns
        those rows use; the main set then padded to the layout's multiple."""
        out = {}
        for key, value in batch.items():
            prefix = _row_set(key, ends)
            width = batch[prefix + DOCUMENT_IDS].shape[1]
            value = value[index]
            if value.dim() >= 2 and value.shape[1] == width:
                value = value[:, :int(ends[prefix][index].max())]
            out[key] = value
        return pad_to_multiple(out, self.multiple)


def _row_ends(batch: Batch) -> dict[str, torch.Tensor]:
    """Per row set (by key prefix), each row's end: the column after its last real token."""
    ends = {}
    for key, doc in batch.items():
        if key.endswith(DOCUMENT_IDS):
            real = doc >= 0
            T = real.shape[1]
            ends[key[:-len(DOCUMENT_IDS)]] = torch.where(
                real.any(1), T - real.flip(1).long().argmax(1), 0)
    if "" not in ends:
        raise ValueError("a token budget needs the batch's document_ids to find its rows' "
                         "real tokens")
    return ends


def _row_set(key: str, ends: dict[str, torch.Tensor]) -> str:
    """The row set a key belongs to: the longest prefix of the key among the sets'."""
    return max((p for p in ends if key.startswith(p)), key=len)
