"""Records -> token examples that fit `max_length`.

Truncation never empties a response silently: an over-long record loses prompt tokens from
the left (the end of a prompt, next to the response, matters most) down to
`min_prompt_tokens`, then response tokens from the right. A pair keeps one prompt for both
responses. A record left with no response tokens, or a pair whose two responses become equal,
is a bad record.
"""

from __future__ import annotations

import dataclasses

from megarlhf.data.records import Record
from megarlhf.data.report import BadRecords
from megarlhf.data.templates import PromptFormat

Ids = tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class Example:
    prompt: Ids
    responses: tuple[Ids, ...]
    """() for prompts, (response,) for SFT, (chosen, rejected) for pairs."""
    margin: float = 0.0
    label: bool | None = None
    """Unpaired (KTO) examples: whether the response is desirable."""
    ref_logps: tuple[float, ...] | None = None
    """Per response, its logprob under a reference model, when computed once ahead of
    training (DPO's `dpo.reference: cached`)."""

    def length(self, i: int = 0) -> int:
        """Tokens in prompt + response i (the prompt alone when there are no responses)."""
        return len(self.prompt) + (len(self.responses[i]) if self.responses else 0)


def fit(prompt: list[int], responses: list[list[int]], *, max_length: int,
        min_prompt_tokens: int | None) -> tuple[list[int], list[list[int]]]:
    """Cut `prompt` (from the left) and then `responses` (from the right) to fit."""
    if not responses:  # a prompt alone (for rollouts) just has to fit
        return prompt[-max_length:], []
    longest = max((len(r) for r in responses), default=0)
    overflow = len(prompt) + longest - max_length
    if overflow <= 0:
        return prompt, responses
    floor = len(prompt) if min_prompt_tokens is None else min(len(prompt), min_prompt_tokens)
    prompt = prompt[min(overflow, len(prompt) - floor):]
    room = max_length - len(prompt)
    return prompt, [r[:max(room, 0)] for r in responses]


def encode_records(records: list[Record], fmt: PromptFormat, *, max_length: int,
                   min_prompt_tokens: int | None, bad: BadRecords,
                   default_margin: float = 0.0) -> list[Example]:
    out = []
    for rec in records:
        prompt = fmt.prompt(rec.prompt)
        responses = [fmt.response(rec.prompt, r) for r in rec.responses]
        if not prompt:
            bad.add(rec.where, "empty prompt", "no tokens")
            continue
        if len(responses) == 2 and responses[0] == responses[1]:
            bad.add(rec.where, "chosen equals rejected")
            continue
        cut_prompt, cut = fit(prompt, responses, max_length=max_length,
                              min_prompt_tokens=min_prompt_tokens)
        if any(not r for r in cut):
            bad.add(rec.where, "response truncated to zero tokens",
                    f"prompt of {len(cut_prompt)} tokens leaves none of max_length={max_length}")
            continue
        if len(cut) == 2 and cut[0] == cut[1]:
            bad.add(rec.where, "chosen equals rejected after truncation",
                    f"max_length={max_length} cuts off where they differ")
            continue
        bad.truncated["prompt"] += len(cut_prompt) < len(prompt)
        bad.truncated["response"] += any(len(c) < len(r) for c, r in zip(cut, responses))
        margin = default_margin if rec.margin is None else rec.margin
        out.append(Example(prompt=tuple(cut_prompt), responses=tuple(map(tuple, cut)),
                           margin=margin, label=rec.label))
    return out
