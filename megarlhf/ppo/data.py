"""Prompts for the PPO loop: a JSONL file of token ids, drawn in a seeded order, resumable."""

from __future__ import annotations

import json

import torch


def read_prompts(path: str) -> list[list[int]]:
    return [ids for _, ids in read_prompt_lines(path)]


def read_prompt_lines(path: str) -> list[tuple[int, list[int]]]:
    """(line number, token ids) of every prompt in the file, so checks can name the line."""
    prompts = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                ids = json.loads(line)["prompt_ids"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{number}: expected {{\"prompt_ids\": [...]}} "
                                 f"({e})") from None
            if not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
                raise ValueError(f"{path}:{number}: prompt_ids must be a non-empty list of "
                                 f"token ids")
            prompts.append((number, ids))
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


class PromptSampler:
    """Epochs over the prompts, each in a fresh order from (seed, epoch); the position is its
    whole state, so a resumed run draws exactly what the uninterrupted one would."""

    def __init__(self, prompts: list[list[int]], *, seed: int):
        self.prompts, self.seed, self.consumed = prompts, seed, 0

    def _order(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 7919 + epoch)
        return torch.randperm(len(self.prompts), generator=g).tolist()

    def next(self, count: int) -> list[list[int]]:
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
