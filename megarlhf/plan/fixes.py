"""Changes that would make a job fit: the smallest step of each kind that does, found by
planning the changed recipe (so a suggestion is itself a plan that passes every check)."""

from __future__ import annotations

import dataclasses
import math

from megarlhf.plan.job import Plan, plan
from megarlhf.ppo.placement import group_specs

MAX_FACTOR = 16
"""Search up to 16x the pipeline depth, the ranks per group and the micro-batch count."""


def _fitting(base: Plan, field: str, *, grow_cluster: bool = False) -> tuple[str, Plan] | None:
    """The first doubling of `field` (up to MAX_FACTOR) whose plan fits; with `grow_cluster`,
    on as many nodes as the changed job needs."""
    factor = 2
    while factor <= MAX_FACTOR:
        value = getattr(base.config, field) * factor
        factor *= 2
        try:
            config = dataclasses.replace(base.config, **{field: value})
            cluster = base.cluster
            if grow_cluster:
                needed = sum(spec.nproc for spec in group_specs(config))
                cluster = dataclasses.replace(
                    cluster, nodes=max(cluster.nodes, math.ceil(needed / cluster.gpus_per_node)))
            candidate = plan(config, cluster, base.prompt_len, base.models)
        except ValueError:  # the change breaks a rule of the recipe or of the layout
            continue
        if candidate.fits:
            where = f" on --nodes {cluster.nodes}" if cluster != base.cluster else ""
            return f"{field}={value}{where}", candidate
    return None


def suggest(base: Plan) -> list[tuple[str, Plan]]:
    """(change, its plan) for each kind of change that fits: a deeper pipeline on the same
    GPUs (fewer parameters per rank), more ranks per group on more nodes (more data
    parallelism: smaller optimizer shards, fewer rows per micro-batch), more micro-batches
    (smaller activations)."""
    found = [_fitting(base, "pipeline_parallel"), _fitting(base, "nproc", grow_cluster=True),
             _fitting(base, "micro_batches")]
    return [fix for fix in found if fix is not None]
