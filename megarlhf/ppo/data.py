"""Prompts for the PPO loop: the run's prompt datasets read and tokenized (megarlhf/data), drawn
in a seeded order, resumable."""

from __future__ import annotations

import functools
import os

import torch

from megarlhf.data.config import DatasetSource
from megarlhf.data.prompts import Prompt, load_prompts
from megarlhf.data.tokenizer import Tokenizer, is_tokenizer, load_tokenizer
from megarlhf.engine.checkpoint import HF_SIDECAR


def tokenizer_path(config) -> str | None:
    """The tokenizer that turns the run's text into the actor's token ids and back:
    `tokenizer`, else the one saved with the actor checkpoint (its hf/ directory), else
    vllm_model_dir's; None when none of them has one."""
    candidates = [config.tokenizer, os.path.join(config.actor, HF_SIDECAR),
                  config.vllm_model_dir]
    for path in candidates:
        if path and (os.path.isfile(path) or is_tokenizer(path)):
            return path
    return None


@functools.lru_cache(maxsize=4)
def run_tokenizer(path: str) -> Tokenizer:
    return load_tokenizer(path)


def read_run_prompts(config, which: str = "prompts") -> tuple[list[Prompt], dict]:
    """The prompts of `config.<which>` ('prompts' or 'val_prompts') and their read report."""
    path = tokenizer_path(config)
    source = DatasetSource(path=getattr(config, which), split=getattr(config, f"{which}_split"),
                           fields=dict(config.prompt_fields))
    return load_prompts(source, (lambda: run_tokenizer(path)) if path else None,
                        tokenizer_path=path, template=config.template,
                        on_bad_record=config.on_bad_record,
                        format_options=format_options(config))


def format_options(config) -> dict:
    """PromptFormat's keyword arguments for the run: the tools' schemas and the system
    message that describes them (environment=tools), the chat_template file's text."""
    from megarlhf.envs.tools import tool_options, tool_schema

    options = {}
    if config.tools:
        options.update(tool_options([tool_schema(spec) for spec in config.tools],
                                    config.tool_parser))
    if config.chat_template:
        with open(config.chat_template, encoding="utf-8") as f:
            options["chat_template"] = f.read()
    return options


def run_format(config, tokenizer: Tokenizer):
    """The run's PromptFormat (what its prompts were rendered with)."""
    from megarlhf.data.templates import PromptFormat

    return PromptFormat(tokenizer, config.template, **format_options(config))


class PromptSampler:
    """Epochs over the prompts, each in a fresh order from (seed, epoch); the position is its
    whole state, so a resumed run draws exactly what the uninterrupted one would."""

    def __init__(self, prompts: list, *, seed: int):
        self.prompts, self.seed, self.consumed = prompts, seed, 0

    def _order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
        return torch.randperm(len(self.prompts), generator=g).tolist()

    def next(self, count: int) -> list:
        out = []
        for k in range(self.consumed, self.consumed + count):
            epoch, pos = divmod(k, len(self.prompts))
            out.append(self.prompts[self._order(epoch)[pos]])
        self.consumed += count
        return out

    def state_dict(self) -> dict:
        return {"consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.consumed = int(state["consumed"])
