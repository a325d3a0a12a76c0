"""Routing replay for mixture-of-experts models: record which experts every token was sent
to, and make a later forward send each token to the given experts, whatever the router now
prefers. A rollout engine's routing replayed in the trainer keeps a near-tie in the router
(which fp32 summation order alone can flip) from sending a token through other experts than
the ones it was sampled with.

One `RoutingReplay` per model (per role): it fills each of the model's routers' own
`router_replay` slot, which megatron-core asks for the top-k at every routing. megatron-core's
`moe_enable_routing_replay` instead registers every router of the process in one class-level
list, which colocated actor, reference and rollout models would share.

The replayed routing weights are the router's own probabilities at the given experts
(renormalised over them when the model renormalises), so gradients reach the router as usual.
Each router keeps its calls in order: a forward consumes one entry per micro-batch, in the
order they were fed. Full activation recomputation would route a second time in backward, so
replay refuses it (selective recomputation does not touch the router). An entry's row of -1
leaves that token to the router's own choice: tokens the engine never routed (padding, a
response's last token, which no logprob reads).

A routing is given per token as [tokens, layers, k] in the order the routers see them
(`local_order` makes it from a micro-batch's [rows, positions, layers, k]); `feed` hands it
to the routers of the model chunk about to run.
"""

from __future__ import annotations

import collections
import contextlib

import torch
import torch.distributed as dist

from megarlhf.compat import megatron as mcore_shims
from megarlhf.parallel.mesh import Mesh


class _RouterSlot:
    """megatron-core's per-router replay interface (`get_replay_topk`, see
    compat.megatron.attach_replay_slot) for one router."""

    def __init__(self):
        self.mode: str | None = None
        self.recorded: list[torch.Tensor] = []
        self.targets: collections.deque[torch.Tensor] = collections.deque()
        self.known = self.moved = 0
        """Replayed tokens, and those of them whose given experts differ from the router's
        (device tensors once counted: no host sync per routing)."""

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None,
                        default_compute_topk=None):
        probs, indices = default_compute_topk(scores, topk, num_groups=num_groups,
                                              group_topk=group_topk)
        if self.mode == "record":
            self.recorded.append(indices.detach().to(torch.int16))
        if self.mode != "replay":
            return probs, indices
        if not self.targets:
            raise RuntimeError("routing replay: a router was called more often than "
                               "routings were given to it")
        given = self.targets.popleft().to(scores.device, non_blocking=True)
        if given.shape != (scores.shape[0], topk):
            raise ValueError(f"routing replay: {tuple(given.shape)} expert indices given for "
                             f"{scores.shape[0]} tokens x top-{topk}")
        known = (given >= 0).all(1, keepdim=True)
        differs = (given.long().sort(1).values != indices.sort(1).values).any(1, keepdim=True)
        self.known = self.known + known.sum()
        self.moved = self.moved + (known & differs).sum()
        indices = torch.where(known, given.long(), indices)
        return torch.where(known, scores.gather(1, indices), probs), indices


class RoutingReplay:
    """Record / replay of the routers of one model's chunks (this rank's layers), keyed by
    global layer number."""

    def __init__(self, chunks: list[torch.nn.Module]):
        self.slots: dict[int, _RouterSlot] = {}
        self._chunk_slots: dict[int, list[tuple[int, _RouterSlot]]] = {}
        """id(chunk) -> (layer number, slot) of its routers: `feed` gets the running chunk."""
        self._full_recompute = False
        for chunk in chunks:
            mine = self._chunk_slots.setdefault(id(chunk), [])
            for number, router in mcore_shims.moe_routers(chunk):
                if router is None:
                    # A routing is [tokens, layers, k] over every layer (`feed` indexes it
                    # by layer number); dense layers among MoE ones are refused on import.
                    raise ValueError("routing replay needs a mixture-of-experts model with "
                                     f"experts in every layer; layer {number} has none")
                if isinstance(mcore_shims.replay_slot(router), _RouterSlot):
                    raise ValueError(f"routing replay: layer {number}'s router already has a "
                                     f"RoutingReplay; use that one")
                self._full_recompute |= router.config.recompute_granularity == "full"
                slot = self.slots.setdefault(number, _RouterSlot())
                mcore_shims.attach_replay_slot(router, slot)
                mine.append((number, slot))

    @contextlib.contextmanager
    def record(self):
        """Inside, every routing's top-k indices [tokens, k] are kept per layer."""
        for slot in self.slots.values():
            slot.mode, slot.recorded = "record", []
        try:
            yield self
        finally:
            for slot in self.slots.values():
                slot.mode = None

    def take_recorded(self) -> list[torch.Tensor]:
        """The last record as one int16 [tokens, layers, k] tensor per forward call, layers
        in order (every layer's router must be on this rank: PP = 1); the record is freed."""
        layers = sorted(self.slots)
        if layers != list(range(1, len(layers) + 1)):
            raise ValueError(f"routing replay: this rank holds the routers of layers {layers}; "
                             f"a whole routing needs every layer (pipeline_parallel=1)")
        calls = zip(*(self.slots[layer].recorded for layer in layers), strict=True)
        out = [torch.stack(per_layer, dim=1) for per_layer in calls]
        for slot in self.slots.values():
            slot.recorded = []
        return out

    @contextlib.contextmanager
    def replay(self):
        """Inside, each router takes the indices `feed` gives it, one entry per call, in
        order; every entry must be used by the time the block ends."""
        if self._full_recompute:
            raise ValueError("routing replay with recompute=full: the recomputed layers would "
                             "route again; use recompute=selective or none")
        for slot in self.slots.values():
            slot.mode, slot.targets = "replay", collections.deque()
            slot.known = slot.moved = 0
        try:
            yield self
            left = {layer: len(slot.targets) for layer, slot in self.slots.items()
                    if slot.targets}
            if left:
                raise RuntimeError(f"routing replay: routings left unused {left}; the forward "
                                   f"ran fewer micro-batches than were fed")
        finally:
            for slot in self.slots.values():
                slot.mode, slot.targets = None, collections.deque()

    def feed(self, chunk: torch.nn.Module, routing: torch.Tensor) -> None:
        """Give the routers of `chunk` their next call's indices: `routing` [tokens, layers,
        k] over all of the model's layers (local_order's result); inside `replay()`."""
        for layer, slot in self._chunk_slots[id(chunk)]:
            if slot.mode != "replay":
                raise RuntimeError("routing replay: feed() outside a replay() block")
            slot.targets.append(routing[:, layer - 1])

    def moved_fraction(self, device) -> float:
        """Of the routings replayed in the last replay block, over the ranks of the default
        process group (collective: each worker group's ranks run a role's passes together),
        the fraction whose given experts differ from the ones the router would have chosen:
        how far the trainer's routing has drifted from the engine's. TP ranks without
        sequence parallelism count the same tokens, which leaves the fraction as it is."""
        counts = torch.zeros(2, dtype=torch.float64, device=device)
        for slot in self.slots.values():
            counts += torch.stack([torch.as_tensor(slot.moved), torch.as_tensor(slot.known)]
                                  ).to(counts)
        dist.all_reduce(counts)
        return float(counts[0] / counts[1].clamp(min=1))


def local_order(routing: torch.Tensor, mesh: Mesh, sequence_parallel: bool) -> torch.Tensor:
    """A micro-batch's routing at this rank's positions (context_parallel.local_inputs
    selects this CP rank's), [rows, positions, layers, k], as this rank's routers see the
    tokens, [tokens, layers, k]: sequence-major (megatron-core's activations are [s, b, h]),
    and under sequence parallelism this TP rank's contiguous share of the sequence."""
    routing = routing.transpose(0, 1)
    if sequence_parallel:
        routing = routing.chunk(mesh.tp, dim=0)[mesh.tp_rank]
    return routing.reshape(-1, *routing.shape[2:])
