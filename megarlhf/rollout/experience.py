"""Rollout output -> the batch the roles score and train on.

Rows are [pad... prompt | response ...pad] (roles/sequences.py): prompts left-padded to the
longest, so every response starts at the same column P, then right-padded. Legend: B rows (one
per completion, a prompt's samples consecutive), T = P + the longest response.
"""

from __future__ import annotations

import dataclasses

import torch

from megarlhf.rollout.engine import Completion
from megarlhf.roles.sequences import SequenceBatch


@dataclasses.dataclass(frozen=True)
class RolloutBatch:
    sequences: SequenceBatch
    engine_logp: torch.Tensor
    """[B, T] float32: the engine's log p(token_t | tokens_<t) on response columns, 0 elsewhere
    (aligned with the trainer's `PolicyRole.logprobs`)."""
    prompt_index: torch.Tensor
    """[B] long: the prompt each row answers (the groups of GRPO / RLOO)."""


def rollout_batch(prompts: list[list[int]], completions: list[Completion], *,
                  pad_token_id: int = 0) -> RolloutBatch:
    _check(prompts, completions)
    P = max(len(prompts[c.prompt_index]) for c in completions)
    T = P + max(len(c.token_ids) for c in completions)
    tokens = torch.full((len(completions), T), pad_token_id, dtype=torch.long)
    attention = torch.zeros_like(tokens)
    response = torch.zeros_like(tokens)
    logp = torch.zeros(len(completions), T, dtype=torch.float32)
    for row, c in enumerate(completions):
        prompt, n = prompts[c.prompt_index], len(c.token_ids)
        tokens[row, P - len(prompt):P] = torch.tensor(prompt, dtype=torch.long)
        tokens[row, P:P + n] = torch.tensor(c.token_ids, dtype=torch.long)
        attention[row, P - len(prompt):P + n] = 1
        response[row, P:P + n] = 1
        logp[row, P:P + n] = torch.tensor(c.logprobs, dtype=torch.float32)
    return RolloutBatch(
        sequences=SequenceBatch(tokens=tokens, attention_mask=attention, response_mask=response),
        engine_logp=logp,
        prompt_index=torch.tensor([c.prompt_index for c in completions], dtype=torch.long))


def _check(prompts: list[list[int]], completions: list[Completion]) -> None:
    if not completions:
        raise ValueError("no completions given")
    for row, c in enumerate(completions):
        if not 0 <= c.prompt_index < len(prompts):
            raise ValueError(f"completion {row} answers prompt {c.prompt_index}, but there are "
                             f"{len(prompts)} prompts")
        if not prompts[c.prompt_index]:
            raise ValueError(f"prompt {c.prompt_index} is empty; a response needs a prompt "
                             f"token before it")
        if not c.token_ids:
            raise ValueError(f"completion {row} has no tokens")
        if len(c.logprobs) != len(c.token_ids):
            raise ValueError(f"completion {row} has {len(c.token_ids)} tokens but "
                             f"{len(c.logprobs)} logprobs")
