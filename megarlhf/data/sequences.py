"""Prompt + response token batches: what reward-model pairs (pairs.py) and rollouts
(rollout/experience.py) are made into, and what the roles compute on.

Legend: B sequences, T positions. Each row is [pad... prompt | response ...pad]: prompts are
left-padded and responses right-padded, so every response starts at the same column.

Per-token outputs are aligned with `tokens`: column t holds the quantity for producing token t
from the tokens before it (log p(token_t | tokens_<t), the value of the state before token t).
Columns without a real token before them (column 0, a prompt's first token, padding) have no
such quantity and hold 0; `response_mask` never covers them.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F


@dataclasses.dataclass(frozen=True)
class SequenceBatch:
    tokens: torch.Tensor
    """[B, T] token ids."""
    attention_mask: torch.Tensor
    """[B, T] 1 on real tokens (prompt and response), 0 on padding."""
    response_mask: torch.Tensor
    """[B, T] 1 on response tokens (the ones the policy produced and is trained on)."""

    def __post_init__(self):
        t = self.tokens
        if t.dim() != 2 or t.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"tokens must be an integer tensor [B, T], got {t.dtype} "
                             f"{tuple(t.shape)}")
        for name in ("attention_mask", "response_mask"):
            mask = getattr(self, name)
            if tuple(mask.shape) != tuple(t.shape):
                raise ValueError(f"{name} has shape {tuple(mask.shape)}, tokens have "
                                 f"{tuple(t.shape)}")
        if bool((self.response_mask.bool() & ~self.attention_mask.bool()).any()):
            raise ValueError("response_mask marks padding positions (attention_mask == 0)")
        first = self.attention_mask.long().argmax(dim=1)  # each row's first real token
        led = self.response_mask.gather(1, first[:, None]).flatten().nonzero().flatten()
        if len(led):
            raise ValueError(f"rows {led.tolist()} have a response token at their first real "
                             f"token (or column 0): it needs a prompt token before it")
        empty = (self.response_mask.sum(dim=1) == 0).nonzero().flatten().tolist()
        if empty:
            raise ValueError(f"rows {empty} have an empty response (no response tokens); drop "
                             f"them or give each at least one token")

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)

    def check_length(self, max_length: int) -> None:
        if self.shape[1] > max_length:
            raise ValueError(f"sequences are {self.shape[1]} tokens long, more than the "
                             f"model's max_position_embeddings={max_length}")

    def right_padded(self, columns: int) -> "SequenceBatch":
        """This batch with `columns` padding columns on the right (token 0, both masks 0)."""
        pad = lambda t: F.pad(t, (0, columns))  # noqa: E731
        return SequenceBatch(tokens=pad(self.tokens), attention_mask=pad(self.attention_mask),
                             response_mask=pad(self.response_mask))

    def position_ids(self) -> torch.Tensor:
        """Positions counted over real tokens only, so left padding does not shift them."""
        return (self.attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)

    def document_ids(self) -> torch.Tensor:
        """[B, T]: 0 on a row's real tokens, a negative id of its own on each padding
        position (models/packed.py, data/packing.document_mask). Attention is then causal
        without padding keys, and a padding query sees only padding, so no softmax row is
        empty (its output is never used)."""
        _, T = self.shape
        padding = -torch.arange(1, T + 1).expand(self.shape)
        return torch.where(self.attention_mask.bool(), 0, padding)

    def model_inputs(self) -> dict[str, torch.Tensor]:
        """The model's inputs for this batch, one row per sequence (roles/batching.py lays
        micro-batches out)."""
        labels = torch.cat([self.tokens[:, 1:], torch.zeros_like(self.tokens[:, :1])], dim=1)
        return {"tokens": self.tokens.long(), "labels": labels.long(),
                "position_ids": self.position_ids(), "document_ids": self.document_ids()}
