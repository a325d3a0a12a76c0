"""Changes that would make a job fit, each found by planning the changed recipe (so a
suggestion is itself a plan that passes every check): the smallest step of each kind of
layout change, and the fewest switches (offload, engine sleep, sequence parallelism,
recomputation) to turn on."""

from __future__ import annotations

import dataclasses
import itertools
import math

from megarlhf.models.lora import LoraConfig
from megarlhf.plan.job import SWITCHES, Plan, plan
from megarlhf.ppo.placement import group_specs

MAX_FACTOR = 16
"""Search up to 16x the pipeline depth, the ranks per group, the micro-batch count, the
context parallelism and the expert parallelism."""
MAX_SWITCH_SETS = 3
"""Switch settings reported: those with the lowest peaks among the fewest switches."""


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
    (smaller activations), context parallelism on the same GPUs (each rank a share of every
    sequence: for long sequences), expert parallelism on the same GPUs (each rank a share of
    the experts: mixture-of-experts models only), LoRA adapters instead of full training."""
    found = [_fitting(base, "pipeline_parallel"), _fitting(base, "nproc", grow_cluster=True),
             _fitting(base, "micro_batches"), _fitting(base, "context_parallel")]
    if any(source.model.is_moe for source in base.models.values()):
        found.append(_fitting(base, "expert_parallel"))
    found.append(_with_lora(base))
    return [fix for fix in found if fix is not None]


def _with_lora(base: Plan) -> tuple[str, Plan] | None:
    """LoRA adapters on the actor (default settings: rank 16 on every projection) instead
    of training every weight, when the recipe allows them and that fits."""
    config = base.config
    if config.lora_of("actor") is not None:
        return None
    layout = dataclasses.replace(config.layout, actor=dataclasses.replace(
        config.layout.actor, lora=LoraConfig()))
    # A 16-bit LoRA actor needs a rollout correction (PPOConfig's check, docs/guides/lora.md).
    correct = config.dtype != "fp32" and config.rollout_correction == "none"
    try:
        candidate = plan(dataclasses.replace(
            config, layout=layout, **({"rollout_correction": "tis"} if correct else {})),
            base.cluster, base.prompt_len, base.models)
    except ValueError:
        return None
    if not candidate.fits:
        return None
    return f"layout.actor.lora.rank={LoraConfig().rank}" + (
        " rollout_correction=tis" if correct else "") + \
        " (train LoRA adapters: the base frozen, no reference copy)", candidate


def switch_options(config) -> list[list[dict]]:
    """Per switch the job has off: the settings it could take instead (recompute: selective
    or full, one at a time)."""
    options = []
    if config.placement == "colocated":
        options += [[{name: True}] for name in SWITCHES if not getattr(config, name)]
    if not config.sequence_parallel and any(
            config.parallel_of(r).tensor_parallel > 1 for r in config.roles):
        options.append([{"sequence_parallel": True}])
    more = {"none": ["selective", "full"], "selective": ["full"]}.get(config.recompute, [])
    if more:
        options.append([{"recompute": level} for level in more])
    return options


def switches(base: Plan) -> list[tuple[str, Plan]]:
    """('name=value ...', its plan) for the fewest switches turned on that make the job fit
    (up to MAX_SWITCH_SETS settings of that many switches, the lowest peaks); none if no
    combination does."""
    options = switch_options(base.config)
    for count in range(1, len(options) + 1):
        found = []
        for chosen in itertools.combinations(options, count):
            for setting in itertools.product(*chosen):
                fields = {k: v for part in setting for k, v in part.items()}
                try:
                    candidate = plan(dataclasses.replace(base.config, **fields), base.cluster,
                                     base.prompt_len, base.models)
                except ValueError:
                    continue
                if candidate.fits:
                    change = " ".join(f"{k}={str(v).lower()}" for k, v in fields.items())
                    found.append((change, candidate))
        if found:  # the most headroom first
            return sorted(found, key=lambda fix: fix[1].worst.peak)[:MAX_SWITCH_SETS]
    return []
