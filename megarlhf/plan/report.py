"""The plan as text: one table per group of ranks (GiB per GPU at its most loaded pipeline
rank), each phase's peak, and the verdict with the largest term and fixes when it does not
fit."""

from __future__ import annotations

from megarlhf.plan.fixes import MAX_FACTOR
from megarlhf.plan.job import GIB, PHASES, GroupPlan, Plan
from megarlhf.plan.params import total_params

COLUMNS = (
    # header, what, phase
    ("weights", "weights", None),
    ("grads", "grads", None),
    ("optimizer", "optimizer", None),
    ("KV cache", "KV cache", "rollout"),
    ("fwd act", "activations", "experience"),
    ("fwd logits", "logits", "experience"),
    ("train act", "activations", "train"),
    ("train logits", "logits", "train"),
)


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.1f}"


def _bits(nbytes: int) -> str:
    return f"{8 * nbytes}-bit"


def header(plan: Plan, recipe: str) -> list[str]:
    c, cluster, nbytes = plan.config, plan.cluster, plan.param_bytes
    engine = "vLLM" if c.rollout_backend == "vllm" else "Megatron"
    rollout = f"{engine} TP{c.rollout_tp} engines, {_bits(nbytes)}"
    lines = [
        f"megarlhf plan: {recipe} on {cluster.nodes} node(s) x {cluster.gpus_per_node} GPUs of "
        f"{cluster.gpu_mem_gb:g} GiB ({_gib(cluster.usable_bytes)} GiB usable: "
        f"{cluster.reserve_fraction:.0%} kept free for the CUDA context, NCCL and fragmentation)",
        f"job: {c.algorithm}, {c.placement} placement, {plan.gpus_needed} of {cluster.gpus} "
        f"GPUs; params {_bits(nbytes)}, fp32 grads, Adam states (+ fp32 master "
        f"weights for 16-bit params) sharded over DP by the distributed optimizer",
        f"batch: {c.prompts_per_step} prompts x {c.samples_per_prompt} samples, sequences of "
        f"{plan.prompt_len} prompt + {c.max_new_tokens} response tokens, {c.mini_batches} "
        f"mini-batch(es) x {c.micro_batches} micro-batch(es) per DP rank; rollout: {rollout}",
    ]
    for role, source in plan.models.items():
        lines.append(f"  {role:7s} {total_params(source.model, value_head=source.value_head):>15,}"
                     f" params ({source.origin})")
    return lines


def group_table(group: GroupPlan) -> list[str]:
    spec = group.spec
    tp, pp = spec.parallel.tensor_parallel, spec.parallel.pipeline_parallel
    dp = spec.parallel.data_parallel_size(spec.nproc)
    lines = [f"group {spec.name}: GPUs {group.first_gpu}-{group.first_gpu + spec.nproc - 1}, "
             f"TP{tp} x PP{pp} x DP{dp}; most loaded rank: pipeline stage {group.pp_rank} of "
             f"{pp} (GiB per GPU)",
             "  " + f"{'role':8s}" + "".join(f"{h:>13s}" for h, _, _ in COLUMNS)
             + f"{'recompute':>13s}"]
    roles = list(dict.fromkeys(t.role for t in group.terms))
    for role in roles:
        cells = []
        for _, what, phase in COLUMNS:
            found = [t.bytes for t in group.terms
                     if t.role == role and t.what == what and t.phase == phase]
            cells.append(_gib(sum(found)) if found else "-")
        recompute = _gib(group.recompute[role]) if role in group.recompute else "-"
        lines.append("  " + f"{role:8s}" + "".join(f"{cell:>13s}" for cell in cells)
                     + f"{recompute:>13s}")
    phases = " | ".join(f"{p} {_gib(group.resident + group.transient(p))}" for p in PHASES)
    lines.append(f"  resident {_gib(group.resident)}; with each phase: {phases}; peak "
                 f"{_gib(group.peak)} GiB ({group.peak_phase})")
    return lines


def render(plan: Plan, recipe: str) -> str:
    lines = header(plan, recipe)
    for group in plan.groups:
        lines += [""] + group_table(group)
    lines.append("")
    worst = plan.worst
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    lines += ["('recompute': train activations with full recomputation, which the PPO trainer "
              "does not use: for comparison)",
              f"peak {_gib(worst.peak)} GiB per GPU (group {worst.spec.name}, "
                  f"{worst.peak_phase}) of {_gib(plan.cluster.usable_bytes)} usable: {verdict}"]
    return "\n".join(lines)


def refusal(plan: Plan, fixes: list[tuple[str, Plan]]) -> str:
    """Why the plan does not fit and what would: the largest term, and the fixes found."""
    worst = plan.worst
    term = worst.largest_term()
    short = worst.peak - plan.cluster.usable_bytes
    lines = [f"does not fit: group {worst.spec.name} needs {_gib(worst.peak)} GiB per GPU at "
             f"pipeline stage {worst.pp_rank} ({worst.peak_phase} phase), "
             f"{_gib(short)} GiB more than the {_gib(plan.cluster.usable_bytes)} GiB usable; "
             f"largest term: {term.role} {term.what} {_gib(term.bytes)} GiB"]
    if fixes:
        lines.append("fixes that fit: " + "; or ".join(
            f"{change} (peak {_gib(fixed.worst.peak)} GiB)" for change, fixed in fixes))
    else:
        lines.append("no single change found that fits: deepening the pipeline, more ranks "
                     f"on more nodes, or more micro-batches (each alone, up to {MAX_FACTOR}x, "
                     "within the recipe's batch-split rules)")
    return "\n".join(lines)
