"""Rows that pack documents, in megatron-core's packed (THD) layout: no attention mask at all.

A micro-batch whose rows [B, T] hold more documents than rows (packed rows: SFT's packer,
the roles' `pack`) runs as one sequence of B*T tokens cut into segments, each attending
causally within itself and to nothing else (rows of one document each keep the batched
document mask: the segment loop below would cost a kernel launch per row):
- a segment is a run of one document id within one row (a packed row holds several, a
  left-padded row one): the rows' producers keep each document contiguous (roles/batching
  refuses padding between real tokens, data/packing places documents whole);
- a run of padding positions (negative ids) is one segment too: its outputs are never read,
  and no real token's segment contains a padding key.
megarlhf's rows give every document positions counting from 0 (data/packing.py,
data/sequences.py), and megatron-core restarts rotary positions at each segment in THD, so a
token's logits are those of its document alone.

The segments reach the core attention as PackedSeqParams (cu_seqlens, max_seqlen):
Transformer Engine's attention reads them natively; `PackedAttention` gives megatron-core's
local attention and our SDPAttention the same layout by running each segment alone with a
causal mask type. That is the varlen reference the CPU tests check packed batches against, and
on a GPU each segment gets SDPA's flash kernel instead of a dense [T, T] block-diagonal mask.
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule


@dataclasses.dataclass
class Segments(PackedSeqParams):
    """PackedSeqParams plus the segment bounds as Python ints, so `PackedAttention` cuts the
    sequence without reading cu_seqlens back from the device once per layer."""

    bounds: tuple[int, ...] = ()


def packed_segments(document_ids: torch.Tensor, device: torch.device) -> Segments | None:
    """The segments of rows with document ids [B, T] (host tensor) where some row packs
    several documents; None where each row holds one: such rows run batched under the
    document mask, one kernel call for all rows instead of one per segment."""
    ids, starts = _runs(document_ids)
    if int((starts & (ids >= 0)).sum()) <= ids.shape[0]:
        return None
    return _segments(starts, device)


def segments(document_ids: torch.Tensor, device: torch.device) -> Segments:
    """The segments of rows with document ids [B, T] (host tensor), cu_seqlens on `device`."""
    return _segments(_runs(document_ids)[1], device)


def _runs(document_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids with every padding id alike (a padding run is one segment), and where each
    run of one id within a row starts."""
    ids = document_ids.clamp(min=-1)
    starts = torch.ones_like(ids, dtype=torch.bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    return ids, starts


def _segments(starts: torch.Tensor, device: torch.device) -> Segments:
    first = starts.reshape(-1).nonzero().squeeze(1)
    bounds = torch.cat([first, torch.tensor([starts.numel()])])
    cu = bounds.to(device=device, dtype=torch.int32)
    longest = int((bounds[1:] - bounds[:-1]).max())
    return Segments(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                    max_seqlen_q=longest, max_seqlen_kv=longest, bounds=tuple(bounds.tolist()))


def flatten(batch: dict, keys: tuple[str, ...]) -> dict:
    """The micro-batch's model-layout tensors `keys` (those it has) as one row [1, B*T, ...]."""
    return {k: batch[k].reshape(1, -1, *batch[k].shape[2:]) for k in keys if k in batch}


def unflatten(per_position: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """The model's per-position output [1, B*T, ...] back in the rows' frame [B, T, ...]."""
    return per_position.reshape(rows, columns, *per_position.shape[2:])


class PackedAttention(MegatronModule):
    """Core attention over any inner core attention that masks causally by itself (local,
    sdpa): THD queries, keys and values [t, heads, d] are cut at the segments' bounds, each
    segment runs alone as a batch of one with a causal mask type, and the outputs are
    concatenated, [t, heads*d]. Without packed sequences it is the inner attention."""

    def __init__(self, config, *, inner: type, **kwargs):
        super().__init__(config=config)
        self.inner = inner(config=config, **kwargs)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None,
                attention_bias=None, packed_seq_params=None):
        if packed_seq_params is None:
            return self.inner(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                              attention_bias=attention_bias)
        if not isinstance(packed_seq_params, Segments) or attention_bias is not None:
            raise NotImplementedError("packed sequences here come as models.packed.Segments, "
                                      "without an attention bias")
        bounds = packed_seq_params.bounds
        outs = [self.inner(query[s:e, None], key[s:e, None], value[s:e, None], None,
                           attn_mask_type=AttnMaskType.causal)
                for s, e in zip(bounds[:-1], bounds[1:])]
        return torch.cat(outs).reshape(query.shape[0], -1)
