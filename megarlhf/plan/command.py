"""`megarlhf plan`: check a PPO recipe against a cluster and print its memory per GPU.

Exit status: 0 fits, 1 does not fit (the reason and fixes on stderr); a recipe or layout that
cannot run at all raises ValueError (the CLI exits 2 with the message).
"""

from __future__ import annotations

import os
import sys

from megarlhf.plan.fixes import suggest, switches
from megarlhf.plan.job import Cluster, check, plan
from megarlhf.plan.report import render, refusal
from megarlhf.configio import load_config
from megarlhf.ppo.config import PPOConfig
from megarlhf.ppo.data import read_run_prompts
from megarlhf.ppo.sources import resolve_models


def prompt_length(config: PPOConfig, given: int | None) -> int:
    """Tokens of the longest prompt: `given`, else measured in the recipe's prompts file."""
    if given is not None:
        if given < 1:
            raise ValueError(f"--prompt-len must be >= 1, got {given}")
        return given
    if not os.path.isfile(config.prompts):
        raise ValueError(f"prompts file {config.prompts} does not exist yet, so the prompt "
                         f"length is unknown: pass --prompt-len N (tokens of the longest "
                         f"prompt)")
    return max(len(p.ids) for p in read_run_prompts(config)[0])


def main(recipe: str, overrides: list[str], cluster: Cluster, *, prompt_len: int | None = None,
         dry_run: bool = False) -> int:
    config = load_config(PPOConfig, recipe, overrides)  # its checkpoints may not exist yet
    models = resolve_models(config)
    length = prompt_length(config, prompt_len)
    if dry_run:
        check(config, cluster, models, length + config.max_new_tokens)
        shapes = ", ".join(f"{role} ({source.origin})" for role, source in models.items())
        print(f"dry run: {recipe} and the layout on {cluster.nodes} node(s) x "
              f"{cluster.gpus_per_node} GPUs check out; models: {shapes}; would estimate "
              f"memory per GPU for sequences of {length} + {config.max_new_tokens} tokens")
        return 0
    result = plan(config, cluster, length, models)
    print(render(result, recipe))
    if result.fits:
        return 0
    print(refusal(result, suggest(result), switches(result)), file=sys.stderr)
    return 1
