"""`megarlhf ppo --dry-run`: the checks a run makes before it starts, and what it would start.

Reads the recipe, the checkpoints' metadata, the prompts file and the reward function's
module; builds no model and starts no process.
"""

from __future__ import annotations

import os

from megarlhf.plan.job import MODEL_ROLES, check_models, resolve_models
from megarlhf.ppo import checkpoints
from megarlhf.ppo.config import PPOConfig
from megarlhf.ppo.data import read_prompts
from megarlhf.ppo.placement import group_specs
from megarlhf.ppo.rewards import load_reward_fn


def ppo(config: PPOConfig) -> str:
    """What `megarlhf ppo` would run for `config` (loaded with its paths checked); ValueError
    naming every problem found."""
    models = resolve_models(config)
    prompts = read_prompts(config.prompts)
    longest = max(len(p) for p in prompts)
    problems = check_models(config, models, longest + config.max_new_tokens)
    problems += [f"{role}: {getattr(config, field)} is an HF model directory, not a megarlhf "
                 f"checkpoint; convert it first (python -m tools.convert_hf.hf_to_mcore --hf "
                 f"DIR --out CKPT [--role critic|reward])"
                 for role, (field, _, _) in MODEL_ROLES.items()
                 if role in models and models[role].origin != "checkpoint"]
    if config.rollout_backend == "vllm" and not os.path.isfile(
            os.path.join(config.vllm_model_dir, "config.json")):
        problems.append(f"vllm_model_dir {config.vllm_model_dir} has no config.json")
    if problems:
        raise ValueError("the run cannot start:\n  " + "\n  ".join(problems))
    if config.reward_fn:
        load_reward_fn(config.reward_fn)  # importable, and a callable
    latest = checkpoints.latest(config.out_dir)
    lines = [f"dry run: would run {config.algorithm} for {config.steps} steps "
             f"({'resuming from ' + latest if latest else 'from step 0'}), "
             f"{len(prompts)} prompts (longest {longest} tokens) x {config.samples_per_prompt} "
             f"samples, {config.prompts_per_step} prompts per step; outputs in {config.out_dir}"]
    for spec in group_specs(config):
        tp, pp = spec.parallel.tensor_parallel, spec.parallel.pipeline_parallel
        lines.append(f"  group {spec.name}: {spec.nproc} {config.worker_group} rank(s), TP{tp} x "
                     f"PP{pp}, roles {', '.join(sorted(spec.roles))}")
    for role, source in models.items():
        m = source.model
        lines.append(f"  {role}: {m.num_layers} layers, hidden {m.hidden_size}, vocab "
                     f"{m.vocab_size} ({source.origin})")
    return "\n".join(lines)
