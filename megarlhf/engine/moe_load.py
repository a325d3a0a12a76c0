"""How evenly a mixture-of-experts model's routers spread tokens over the expert-parallel ranks,
measured in training, against what the memory planner assumes.

Routing is dropless: every token reaches its k experts, however many pick the same ones, so
the busiest EP rank's experts hold more activations than the mean. The planner sizes them at
MOE_IMBALANCE times the mean (plan/memory.py); each training step counts, per MoE layer, the
tokens routed to each expert over the ranks of its pipeline stage, and reports the busiest EP
rank's share over the mean (the largest over layers), with a warning when it exceeds that.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps
from megatron.core.transformer.moe.router import TopKRouter

from megarlhf.parallel.mesh import Mesh

log = logging.getLogger(__name__)

MOE_IMBALANCE = 2.0
"""Assumed ratio of the tokens routed to the busiest EP rank's experts to the mean: the
planner's headroom for dropless routing."""


class ExpertLoad:
    """Counts the routers' choices of one model's chunks (forward hooks on its routers)."""

    def __init__(self, chunks: list[torch.nn.Module], mesh: Mesh, num_experts: int):
        self.mesh, self.num_experts = mesh, num_experts
        self._counts: dict[int, torch.Tensor] = {}
        self._warned = False
        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    module.register_forward_hook(self._count)

    def _count(self, router: TopKRouter, _inputs, outputs) -> None:
        routing_map = outputs[1]  # [tokens, experts], True where a token goes
        counts = routing_map.sum(dim=0, dtype=torch.int64).detach()
        if router.layer_number in self._counts:
            self._counts[router.layer_number] += counts
        else:
            self._counts[router.layer_number] = counts

    def reset(self) -> None:
        self._counts = {}

    def busiest_over_mean(self) -> float:
        """The busiest EP rank's routed tokens over the mean, the largest over this model's
        layers since `reset`, the same on every rank (collective). Recomputed forwards count
        twice, and TP ranks without sequence parallelism see the same tokens: both scale
        every expert alike, which leaves the ratio as it is."""
        ep = self.mesh.ep
        worst = torch.zeros((), dtype=torch.float64, device=self.mesh.device)
        if self._counts:
            counts = torch.stack([self._counts[k] for k in sorted(self._counts)]).double()
            dist.all_reduce(counts, group=ps.get_tensor_and_data_parallel_group(
                with_context_parallel=True))
            per_rank = counts.view(len(counts), ep, self.num_experts // ep).sum(dim=2)
            mean = per_rank.mean(dim=1).clamp(min=1.0)
            worst = (per_rank.max(dim=1).values / mean).max()
        dist.all_reduce(worst, op=dist.ReduceOp.MAX, group=self.mesh.pp_group)
        ratio = float(worst)
        if ratio > MOE_IMBALANCE and not self._warned:
            self._warned = True
            log.warning("mixture of experts: the busiest expert-parallel rank received %.2fx "
                        "the mean routed tokens in a layer, above the %.1fx the memory plan "
                        "assumes; its activations may exceed the plan", ratio, MOE_IMBALANCE)
        return ratio
