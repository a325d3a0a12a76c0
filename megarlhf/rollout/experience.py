"""Rollout output -> the batch the roles score and train on.

Rows are [pad... prompt | response ...pad] (data/sequences.py): prompts left-padded to the
longest, so every response starts at the same column P, then right-padded. Legend: B rows (one
per completion, a prompt's samples consecutive), T = P + the longest response.

A multi-turn episode is one completion: its model turns and the observations between them
(`Completion.sampled` False), all real tokens of the row; the response mask covers the model's
tokens only.
"""

from __future__ import annotations

import dataclasses

import torch

from megarlhf.data.sequences import SequenceBatch
from megarlhf.rollout.engine import Completion


@dataclasses.dataclass(frozen=True)
class RolloutBatch:
    sequences: SequenceBatch
    engine_logp: torch.Tensor
    """[B, T] float32: the engine's log p(token_t | tokens_<t) on response columns, 0 elsewhere
    (aligned with the trainer's `PolicyRole.logprobs`)."""
    prompt_index: torch.Tensor
    """[B] long: the prompt each row answers (the groups of GRPO / RLOO)."""
    routing: torch.Tensor | None = None
    """[B, T, layers, k] int16: the experts the engine sent each token to, -1 where it sent
    none (padding, a response's last token); None when the completions carry no routing."""
    rewards_at: torch.Tensor | None = None
    """[B, T] float32: rewards given at tokens before a row's last (the turns of multi-turn
    episodes, each at its last model token), 0 elsewhere; None when none were given."""


def rollout_batch(prompts: list[list[int]], completions: list[Completion], *,
                  pad_token_id: int = 0,
                  rewards_at: list[list[tuple[int, float]]] | None = None) -> RolloutBatch:
    """`rewards_at`: per completion, (index into its tokens, reward) pairs placed in
    `RolloutBatch.rewards_at`."""
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
        sampled = torch.tensor(c.sampled if c.sampled is not None else [True] * n)
        response[row, P:P + n] = sampled.long()
        logp[row, P:P + n] = torch.where(sampled, torch.tensor(c.logprobs), 0.0)
    placed = None
    if rewards_at is not None:
        if len(rewards_at) != len(completions):
            raise ValueError(f"rewards_at has {len(rewards_at)} rows for {len(completions)} "
                             f"completions")
        placed = torch.zeros(len(completions), T, dtype=torch.float32)
        for row, pairs in enumerate(rewards_at):
            if any(not 0 <= i < len(completions[row].token_ids) for i, _ in pairs):
                raise ValueError(f"rewards_at row {row} places a reward outside its "
                                 f"{len(completions[row].token_ids)} tokens")
            for index, reward in pairs:
                placed[row, P + index] += reward
    return RolloutBatch(
        sequences=SequenceBatch(tokens=tokens, attention_mask=attention, response_mask=response),
        engine_logp=logp,
        prompt_index=torch.tensor([c.prompt_index for c in completions], dtype=torch.long),
        routing=_routing(prompts, completions, P, T), rewards_at=placed)


def response_tokens_where(batch: SequenceBatch, flags: list[list[bool]]) -> torch.Tensor:
    """[B, T] long: the response positions of `batch` (rollout_batch's layout: every response
    starts at one column) whose completion token is flagged (`flags`: per completion, one per
    token)."""
    T = batch.response_mask.shape[1]
    start = T - max(len(f) for f in flags)
    out = torch.zeros_like(batch.response_mask)
    for row, row_flags in enumerate(flags):
        out[row, start:start + len(row_flags)] = torch.tensor(row_flags, dtype=out.dtype)
    return out * batch.response_mask


def _routing(prompts: list[list[int]], completions: list[Completion], P: int, T: int
             ) -> torch.Tensor | None:
    if completions[0].routing is None:
        return None
    out = torch.full((len(completions), T, *completions[0].routing.shape[1:]), -1,
                     dtype=torch.int16)
    for row, c in enumerate(completions):
        start = P - len(prompts[c.prompt_index])
        out[row, start:start + len(c.routing)] = c.routing
    return out


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
        if c.sampled is not None and (len(c.sampled) != len(c.token_ids) or
                                      not any(c.sampled)):
            raise ValueError(f"completion {row}'s sampled mask has {len(c.sampled)} entries "
                             f"({sum(c.sampled)} sampled) for {len(c.token_ids)} tokens; it "
                             f"needs one per token and at least one sampled")
        fed = len(prompts[c.prompt_index]) + len(c.token_ids) - 1
        first = completions[0].routing
        if c.routing is None or first is None:
            fits = c.routing is first  # both None
        else:
            fits = len(c.routing) == fed and c.routing.shape[1:] == first.shape[1:]
        if not fits:
            raise ValueError(f"completion {row}'s routing is "
                             f"{None if c.routing is None else tuple(c.routing.shape)}; every "
                             f"completion needs one of [{fed}, layers, k] (its prompt and "
                             f"response but the last token), or none does")
