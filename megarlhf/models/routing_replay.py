"""Routing replay for mixture-of-experts models: record which experts every token was sent
to, and make a later forward send each token to the recorded experts, whatever the router now
prefers. A rollout engine's routing replayed in the trainer keeps a near-tie in the router
(which fp32 summation order alone can flip) from sending a token through other experts than
the ones it was sampled with.

One `RoutingReplay` per model (per role): it fills each of the model's routers' own
`router_replay` slot, which megatron-core asks for the top-k at every routing. megatron-core's
`moe_enable_routing_replay` instead registers every router of the process in one class-level
list, which colocated actor, reference and rollout models would share.

The replayed routing weights are the router's own probabilities at the recorded experts
(renormalised over them when the model renormalises), so gradients reach the router as usual.
Each router keeps its calls in order: a forward consumes one recorded entry per micro-batch,
in the order they were recorded. Full activation recomputation would route a second time in
backward, so replay refuses it (selective recomputation does not touch the router).
"""

from __future__ import annotations

import collections
import contextlib

import torch
from megatron.core.transformer.moe.router import TopKRouter


class _RouterSlot:
    """megatron-core's per-router replay interface (`get_replay_topk`) for one router."""

    def __init__(self):
        self.mode: str | None = None
        self.recorded: list[torch.Tensor] = []
        self.targets: collections.deque[torch.Tensor] = collections.deque()

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None,
                        default_compute_topk=None):
        if self.mode == "replay":
            if not self.targets:
                raise RuntimeError("routing replay: a router was called more often than "
                                   "routings were given to it")
            indices = self.targets.popleft().to(scores.device)
            if indices.shape != (scores.shape[0], topk):
                raise ValueError(f"routing replay: {tuple(indices.shape)} recorded expert "
                                 f"indices for {scores.shape[0]} tokens x top-{topk}")
            return scores.gather(1, indices), indices
        probs, indices = default_compute_topk(scores, topk, num_groups=num_groups,
                                              group_topk=group_topk)
        if self.mode == "record":
            self.recorded.append(indices.detach().clone())
        return probs, indices


class RoutingReplay:
    """Record / replay of the routers of one model's chunks (this rank's layers), keyed by
    global layer number."""

    def __init__(self, chunks: list[torch.nn.Module]):
        self.slots: dict[int, _RouterSlot] = {}
        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    if module.config.recompute_granularity == "full":
                        raise ValueError("routing replay with recompute=full: the recomputed "
                                         "layers would route again; use recompute=selective "
                                         "or none")
                    module.router_replay = self.slots.setdefault(module.layer_number,
                                                                 _RouterSlot())
        if not self.slots:
            raise ValueError("routing replay needs a mixture-of-experts model; this one has "
                             "no router")

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

    def recorded(self) -> dict[int, list[torch.Tensor]]:
        """{layer number: the indices of each routing, in call order} of the last record."""
        return {layer: list(slot.recorded) for layer, slot in self.slots.items()}

    @contextlib.contextmanager
    def replay(self, routing: dict[int, list[torch.Tensor]]):
        """Inside, each router takes the given indices, one entry per call, in order; every
        entry must be used by the time the block ends."""
        if set(routing) != set(self.slots):
            raise ValueError(f"routing replay: routings for layers {sorted(routing)}, this "
                             f"model's routers are layers {sorted(self.slots)}")
        for layer, slot in self.slots.items():
            slot.mode, slot.targets = "replay", collections.deque(routing[layer])
        try:
            yield self
            left = {layer: len(slot.targets) for layer, slot in self.slots.items()
                    if slot.targets}
            if left:
                raise RuntimeError(f"routing replay: routings left unused {left}; the forward "
                                   f"ran fewer micro-batches than were recorded")
        finally:
            for slot in self.slots.values():
                slot.mode, slot.targets = None, collections.deque()
