"""The plan as text: one table per group of ranks (GiB per GPU at its most loaded pipeline
rank: each term in each phase it is on the device, and each phase's peak), the pinned host
memory per node, and the verdict with the largest term and the fixes when it does not fit."""

from __future__ import annotations

from megarlhf.plan.fixes import MAX_FACTOR
from megarlhf.plan.job import GIB, PHASES, SWITCHES, GroupPlan, Plan
from megarlhf.plan.params import saved_bytes, total_params
from megarlhf.ppo.config import TRAINED_ROLES

ROW_ORDER = ("weights", "grads", "optimizer", "forward pass", "activations", "backward",
             "KV cache", "generation", "sync buffers")


def _gib(nbytes: int) -> str:
    return f"{nbytes / GIB:.1f}"


def _bits(nbytes: int) -> str:
    return f"{8 * nbytes}-bit"


def _activations(plan: Plan) -> str:
    """Each model role's sequence parallelism and (trained roles) recomputation."""
    c, parts = plan.config, []
    for role in plan.models:
        sp = "SP" if c.parallel_of(role).sequence_parallel else "no SP"
        recompute = f", recompute {c.recompute_of(role)}" if role in ("actor", "critic") else ""
        parts.append(f"{role} {sp}{recompute}")
    return "; ".join(parts)


def header(plan: Plan, recipe: str) -> list[str]:
    c, cluster, nbytes = plan.config, plan.cluster, plan.param_bytes
    engine = "vLLM" if c.rollout_backend == "vllm" else "Megatron"
    rollout = f"{engine} TP{c.rollout_tp} engines, {_bits(nbytes)}"
    on = [name for name in SWITCHES if getattr(c, name)]
    lines = [
        f"megarlhf plan: {recipe} on {cluster.nodes} node(s) x {cluster.gpus_per_node} GPUs of "
        f"{cluster.gpu_mem_gb:g} GiB ({_gib(cluster.usable_bytes)} GiB usable: "
        f"{cluster.reserve_fraction:.0%} kept free for the CUDA context, NCCL and fragmentation)"
        f" and {cluster.host_mem_gb:g} GiB of host memory per node "
        f"({_gib(cluster.usable_host_bytes)} GiB usable for pinned memory)",
        f"job: {c.algorithm}, {c.placement} placement, {plan.gpus_needed} of {cluster.gpus} "
        f"GPUs; params {_bits(nbytes)}, fp32 grads, Adam states (+ fp32 master "
        f"weights for 16-bit params) sharded over DP (x CP) by the distributed optimizer",
        f"batch: {c.prompts_per_step} prompts x {c.samples_per_prompt} samples, sequences of "
        f"{plan.prompt_len} prompt + {c.max_new_tokens} response tokens, {c.mini_batches} "
        f"mini-batch(es) x {c.micro_batches} micro-batch(es) per DP rank; rollout: {rollout}",
        f"between phases: {', '.join(on) if on else 'nothing offloaded, engines awake'}; "
        f"activations: {_activations(plan)}",
    ]
    for role, source in plan.models.items():
        lines.append(f"  {role:7s} {total_params(source.model, value_head=source.value_head):>15,}"
                     f" params ({source.origin})")
    return lines + [checkpoint_line(plan)]


def checkpoint_line(plan: Plan) -> str:
    """What each save writes: the trained roles' weights and Adam states, or under LoRA their
    adapters (and value head) with theirs."""
    c, parts, total = plan.config, [], 0
    for role in (r for r in TRAINED_ROLES if r in plan.models):
        source, lora = plan.models[role], c.lora_of(role)
        nbytes = saved_bytes(source.model, value_head=source.value_head, lora=lora,
                             param_bytes=plan.param_bytes)
        total += nbytes
        parts.append(f"{role} {_gib(nbytes)} GiB" + (" (LoRA adapters: the base is "
                                                      "referenced, not saved)" if lora else ""))
    return (f"checkpoint per save: {'; '.join(parts)}; out_dir keeps {c.keep_last}: "
            f"{_gib(total * c.keep_last)} GiB")


def group_table(group: GroupPlan) -> list[str]:
    spec, stage = group.spec, group.most_loaded
    pp = spec.parallel.pipeline_parallel
    dp = spec.parallel.data_parallel_size(spec.nproc)
    lines = [f"group {spec.name}: GPUs {group.first_gpu}-{group.first_gpu + spec.nproc - 1}, "
             f"{spec.parallel.describe(dp)}; most loaded rank: pipeline stage {group.pp_rank} of "
             f"{pp} (GiB per GPU in each phase; * only while its role runs)",
             "  " + f"{'term':24s}" + "".join(f"{p:>11s}" for p in PHASES)]
    rows = []
    for t in stage.terms:
        if (t.role, t.what) not in rows:
            rows.append((t.role, t.what))
    rows.sort(key=lambda k: ROW_ORDER.index(k[1]) if k[1] in ROW_ORDER else len(ROW_ORDER))
    roles = list(dict.fromkeys(t.role for t in stage.terms))
    rows.sort(key=lambda k: roles.index(k[0]))  # stable: by role, then by ROW_ORDER
    for role, what in rows:
        label = f"{role} {'train ' if what in ('activations', 'backward') else ''}{what}"
        cells = []
        for phase in PHASES:
            terms = [t for t in stage.terms if t.role == role and t.what == what
                     and t.on_device(phase)]
            cell = "-"
            if terms:
                cell = _gib(sum(t.bytes for t in terms)) \
                    + ("*" if any(phase in t.running for t in terms) else "")
            cells.append(cell)
        lines.append("  " + f"{label:24s}" + "".join(f"{c:>11s}" for c in cells))
    lines.append("  " + f"{'phase peak':24s}"
                 + "".join(f"{_gib(stage.phase_peak(p)):>11s}" for p in PHASES))
    if len(group.stages) > 1:
        lines.append("  " + f"{'  at any stage':24s}"
                     + "".join(f"{_gib(group.phase_peak(p)):>11s}" for p in PHASES))
    lines.append(f"  peak {_gib(group.peak)} GiB ({group.peak_phase}); pinned host memory "
                 f"{_gib(stage.pinned_bytes)} GiB per rank at this stage")
    return lines


def phase_peaks(plan: Plan) -> str:
    """Each phase's peak over the groups: 'rollout 20.1 | experience ...'."""
    return " | ".join(f"{p} {_gib(max(g.phase_peak(p) for g in plan.groups))}"
                      for p in PHASES)


def render(plan: Plan, recipe: str) -> str:
    lines = header(plan, recipe)
    for group in plan.groups:
        lines += [""] + group_table(group)
    lines.append("")
    worst = plan.worst
    verdict = "fits" if plan.fits else "DOES NOT FIT"
    lines += [f"per-phase peaks (GiB per GPU): {phase_peaks(plan)}",
              f"{_host_label(plan)} per node: {_gib(plan.host_peak)} GiB (node "
              f"{plan.host_node}) of {_gib(plan.cluster.usable_host_bytes)} usable",
              f"peak {_gib(worst.peak)} GiB per GPU (group {worst.spec.name}, "
              f"{worst.peak_phase}) of {_gib(plan.cluster.usable_bytes)} usable: {verdict}"]
    return "\n".join(lines)


def refusal(plan: Plan, fixes: list[tuple[str, Plan]],
            switches: list[tuple[str, Plan]] = ()) -> str:
    """Why the plan does not fit and what would: the largest term, the host memory, and the
    fixes and switch settings found."""
    lines = []
    worst, usable = plan.worst, plan.cluster.usable_bytes
    if not plan.fits_gpu:
        term = worst.largest_term()
        lines.append(f"does not fit: group {worst.spec.name} needs {_gib(worst.peak)} GiB per "
                     f"GPU at pipeline stage {worst.pp_rank} ({worst.peak_phase} phase), "
                     f"{_gib(worst.peak - usable)} GiB more than the {_gib(usable)} GiB "
                     f"usable; largest term: {term.role} {term.what} {_gib(term.bytes)} GiB")
    if not plan.fits_host:
        host = plan.cluster.usable_host_bytes
        lines.append(f"does not fit: node {plan.host_node} pins {_gib(plan.host_peak)} GiB of "
                     f"offloaded weights and optimizer states, {_gib(plan.host_peak - host)} "
                     f"GiB more than the {_gib(host)} GiB usable of its "
                     f"{plan.cluster.host_mem_gb:g} GiB (--host-mem-gb)")
    if fixes:
        lines.append("fixes that fit: " + "; or ".join(
            f"{change} (peak {_gib(fixed.worst.peak)} GiB)" for change, fixed in fixes))
    if switches:
        lines.append("switches that fit: " + "; or ".join(
            f"{change} (peak {_gib(fixed.worst.peak)} GiB, pinned host memory "
            f"{_gib(fixed.host_peak)} GiB per node)" for change, fixed in switches))
    if not fixes and not switches:
        lines.append("no change found that fits: deepening the pipeline, more ranks on more "
                     f"nodes, or more micro-batches (each alone, up to {MAX_FACTOR}x, within "
                     "the recipe's batch-split rules), nor any combination of "
                     f"{', '.join(SWITCHES)}, sequence_parallel and recompute")
    return "\n".join(lines)


def _host_label(plan: Plan) -> str:
    if plan.config.sync_mode == "delta":
        return "host memory (pinned, and delta-sync copies)"
    return "pinned host memory"
