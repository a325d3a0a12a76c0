"""Which part of which layout-free Megatron tensor each local parameter holds.

Megatron's `sharded_state_dict` already knows, for every parameter of a rank at any TP / PP /
virtual-PP layout, the global key, layer and offsets (including the fused gate/up MLP whose TP
shard is two separate slices). Both directions of in-memory weight movement use it: the bridge
assembles full per-layer tensors from the pieces of a TP group, and an inference model copies
full tensors into its own pieces.
"""

from __future__ import annotations

import dataclasses

import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories


Unit = tuple[str, tuple[int, ...]]
"""(Megatron checkpoint key, (layer[, expert]) index or ()): one full per-layer tensor."""


@dataclasses.dataclass(frozen=True)
class Piece:
    key: str
    """Layout-free checkpoint key ('decoder.layers.mlp.linear_fc1.weight')."""
    index: tuple[int, ...]
    """Global (layer,) index for stacked keys, (layer, expert) for an MoE layer's experts,
    () for whole tensors."""
    data: torch.Tensor
    """A view of the local parameter (writes go to the model)."""
    offsets: tuple[int, ...]
    """Where `data` sits in the full per-layer tensor."""
    full_shape: tuple[int, ...]
    """Shape of the full per-layer tensor (vocab rows padded for the model's TP)."""

    @property
    def unit(self) -> Unit:
        return self.key, self.index

    @property
    def is_whole(self) -> bool:
        return tuple(self.data.shape) == self.full_shape

    def region(self, full: torch.Tensor) -> torch.Tensor:
        """The part of `full` (a full per-layer tensor) that this piece holds."""
        for dim, (offset, length) in enumerate(zip(self.offsets, self.data.shape)):
            full = full.narrow(dim, offset, length)
        return full


def local_pieces(chunks: list[torch.nn.Module]) -> list[Piece]:
    """The pieces of this rank's model chunks (DDP-wrapped or not), replicas included."""
    pieces = []
    for chunk in chunks:
        module = getattr(chunk, "module", chunk)
        sharded = module.sharded_state_dict()
        apply_factories(sharded)
        for sh in nested_values(sharded):
            if not isinstance(sh, ShardedTensor) or sh.data is None:
                continue  # extra states (ShardedObject) carry no weights
            prepend = sh.prepend_axis_num
            pieces.append(Piece(
                key=sh.key,
                index=tuple(sh.global_offset[:prepend]),
                data=sh.data,
                offsets=tuple(sh.global_offset[prepend:]),
                full_shape=tuple(sh.global_shape[prepend:]),
            ))
    return pieces
