"""`megarlhf ppo --dry-run`: the checks a run makes before it starts, and what it would start.

Reads the recipe, the checkpoints' metadata, the prompts file and the reward function's
module; builds no model and starts no process.
"""

from __future__ import annotations

from megarlhf.ppo import run_dir
from megarlhf.ppo.algorithms import describe
from megarlhf.ppo.config import PPOConfig
from megarlhf.ppo.inputs import read_inputs
from megarlhf.ppo.placement import group_specs
from megarlhf.ppo.sources import resolve_models


def ppo(config: PPOConfig) -> str:
    """What `megarlhf ppo` would run for `config` (loaded with its paths checked); ValueError
    naming every problem found."""
    # What the run checks before it starts a rank, in the same order.
    config.check_paths()
    run_dir.check_out_dir(config.out_dir)
    data = read_inputs(config)  # starts no reward worker: they start at the first call
    checked, prompts = data.checked, data.train
    latest, _ = run_dir.resume_point(config, run_dir.run_inputs(config, prompts))
    models = resolve_models(config)
    longest = max(len(p.ids) for p in prompts + data.val)
    dropped = f" ({len(checked.overlong)} overlong dropped)" if checked.overlong else ""
    lines = [f"dry run: would run {config.algorithm} for {config.steps} steps "
             f"({'resuming from ' + latest if latest else 'from step 0'}), "
             f"{len(prompts)} prompts{dropped} (longest {longest} tokens) x "
             f"{config.samples_per_prompt} samples, {config.prompts_per_step} prompts per step; "
             f"outputs in {config.out_dir}",
             f"  {config.algorithm}: {describe(config)}",
             f"  samples stop on token ids {list(checked.stop_token_ids)}",
             f"  prompts: {data.report['prompts']['template']} format, "
             f"{data.report['prompts']['skipped']} row(s) skipped"
             + (f"; {len(data.val)} validation prompts" if data.val else "")]
    if config.environment is not None:
        tools = (f"; tools {sorted(data.toolbox.by_name)} ({config.tool_parser} calls)"
                 if data.toolbox is not None else "")
        lines.append(f"  episodes: environment {config.environment}, up to {config.max_turns} "
                     f"turns of <= {config.turn_tokens} tokens, <= {config.max_new_tokens} "
                     f"tokens after the prompt, observations <= {config.observation_tokens}"
                     f"{tools}")
    for name, size in checked.teacher_sizes.items():
        lines.append(f"  vLLM teacher {name}: max_model_len {size.max_model_len}, KV cache "
                     f"{size.kv_cache_bytes} bytes per rank")
    if config.agent is not None:
        lines.append(f"  episodes: agent {config.agent} over an OpenAI-compatible endpoint on "
                     f"loopback, up to {config.max_turns} calls and <= {config.max_new_tokens} "
                     f"tokens after the prompt per episode, {config.agent_timeout:g} s each")
    if data.judge is not None:
        j = config.reward_judge
        where = ("the rollout ranks' Megatron engines" if config.placement == "colocated"
                 else f"{config.judge_nproc} rank(s) of its own, {j.backend} engines of TP "
                      f"{config.judge_tp}")
        size = (f", max_model_len {data.judge_size.max_model_len}, KV cache "
                f"{data.judge_size.kv_cache_bytes} bytes per rank"
                if data.judge_size is not None else "")
        lines.append(f"  judge: {j.model}, verdict {j.verdict}, <= {j.max_new_tokens} new "
                     f"tokens, template {j.template} (placeholders checked), on {where}{size}")
    if checked.engine_size is not None:
        size = checked.engine_size
        lines.append(f"  vLLM engines: max_model_len {size.max_model_len}, KV cache "
                     f"{size.kv_cache_bytes} bytes per rank" if size.kv_cache_bytes is not None
                     else f"  vLLM engines: max_model_len {size.max_model_len}, KV cache "
                          f"{size.gpu_memory_utilization:.0%} of device memory")
    for spec in group_specs(config):
        lines.append(f"  group {spec.name}: {spec.nproc} {config.worker_group} rank(s), "
                     f"{spec.parallel.describe()}, roles "
                     f"{', '.join(sorted(spec.roles))}")
    for role, source in models.items():
        m = source.model
        lines.append(f"  {role}: {m.num_layers} layers, hidden {m.hidden_size}, vocab "
                     f"{m.vocab_size} ({source.origin})")
    return "\n".join(lines)
