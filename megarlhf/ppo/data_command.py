"""`megarlhf data`: what a PPO recipe's rollouts will see, without starting anything: each prompt
dataset's rows kept and skipped (by reason), the prompt format, token counts, the prompts that do
not fit next to max_new_tokens, and the first prompts as the model will read them (template
applied, decoded back from the token ids) with their ground truth. `--write-cache FILE` writes
the tokenized prompts, which `prompts=FILE` then reads as they are (checksum verified)."""

from __future__ import annotations

import statistics

from megarlhf.configio import load_config
from megarlhf.data.images import collapse, describe
from megarlhf.data.prompts import Prompt, write_prompt_cache
from megarlhf.ppo.config import PPOConfig
from megarlhf.ppo.data import read_run_prompts, run_tokenizer, tokenizer_path

DATASETS = ("prompts", "val_prompts")


def main(recipe: str, overrides: list[str], *, show: int = 3, write_cache: str | None = None,
         dataset: str = "prompts") -> int:
    config = load_config(PPOConfig, recipe, overrides)
    if getattr(config, dataset) is None:
        raise ValueError(f"--dataset {dataset}: the recipe sets no {dataset}")
    path = tokenizer_path(config)
    limit = _length_limit(config)
    for which in DATASETS:
        if getattr(config, which) is None:
            continue
        prompts, report = read_run_prompts(config, which)
        print(_describe(which, prompts, report, limit, path))
        for prompt in prompts[:show]:
            print(_render(prompt, path))
        if write_cache and which == dataset:
            digest = write_prompt_cache(prompts, write_cache, tokenizer_path=path,
                                        source=getattr(config, which))
            print(f"wrote {len(prompts)} tokenized prompts to {write_cache} (sha256 "
                  f"{digest[:12]}); use {which}={write_cache}")
    return 0


def _length_limit(config: PPOConfig) -> tuple[int, str] | None:
    """The most prompt tokens that fit next to max_new_tokens, and what sets it; None when
    the models cannot be read (yet)."""
    from megarlhf.ppo.preflight import fit_limit
    from megarlhf.ppo.sources import resolve_models

    try:
        models = resolve_models(config)
    except (ValueError, OSError):
        return None
    limit, what, _ = fit_limit(config, models)  # what preflight holds the prompts to
    return limit - config.max_new_tokens, f"{what} - max_new_tokens {config.max_new_tokens}"


def _describe(which: str, prompts: list[Prompt], report: dict, limit, tokenizer: str | None
              ) -> str:
    lengths = [len(p.ids) for p in prompts]
    lines = [f"{which}: {report['path']}: {report['kept']} prompts kept, {report['skipped']} "
             f"skipped{' ' + str(report['reasons']) if report['reasons'] else ''}; format "
             f"{report['template']}; tokenizer {tokenizer or 'none'}",
             f"  tokens per prompt: min {min(lengths)}, mean {statistics.mean(lengths):.1f}, "
             f"max {max(lengths)}"]
    images = [p.images for p in prompts if p.images is not None]
    if images:
        counts = [sum(i.tokens) for i in images]
        lines.append(f"  image tokens (counted above): {sum(len(i.tokens) for i in images)} "
                     f"images on {len(images)} prompts; per prompt min {min(counts)}, mean "
                     f"{statistics.mean(counts):.1f}, max {max(counts)}")
    if limit is None:
        lines.append("  overlong: unknown (the actor's model cannot be read yet)")
    else:
        most, why = limit
        over = [p for p in prompts if len(p.ids) > most]
        lines.append(f"  overlong: {len(over)} prompt(s) above {most} tokens ({why})"
                     + (f", first at {over[0].where}" if over else ""))
    with_truth = sum(p.ground_truth is not None for p in prompts)
    sources = sorted({p.data_source for p in prompts if p.data_source is not None})
    lines.append(f"  ground truth on {with_truth} of {len(prompts)}; data sources: "
                 f"{', '.join(sources) if sources else 'none'}")
    lines += [f"  example: {e}" for e in report["examples"]]
    return "\n".join(lines)


def _render(prompt: Prompt, tokenizer: str | None) -> str:
    ids, tokens = prompt.ids, f"{len(prompt.ids)} tokens"
    if prompt.images is not None:
        ids = collapse(ids, prompt.images)  # an image's pads are shown once
        tokens += (f", {sum(prompt.images.tokens)} of them image tokens: "
                   f"{describe(prompt.images)}; each image's pads shown once")
    text = run_tokenizer(tokenizer).decode(ids) if tokenizer else str(list(ids))
    extra = f"  ground_truth: {prompt.ground_truth!r}" if prompt.ground_truth is not None else ""
    if prompt.data_source is not None:
        extra += f"  data_source: {prompt.data_source}"
    return f"--- {prompt.where} ({tokens}){extra}\n{text}"
