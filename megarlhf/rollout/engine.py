"""What every rollout engine offers the trainer, whatever runs underneath (vLLM, Megatron).

Token ids in, token ids and per-token logprobs out. Logprobs are the model's own
log-softmax of the sampled token (before temperature, top-k/top-p or penalties), the quantity
the trainer recomputes, so the two can be compared (see `rollout.gap`).
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Protocol

import torch


@dataclasses.dataclass(frozen=True, kw_only=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    """0 = greedy."""
    top_p: float = 1.0
    top_k: int = 0
    """0 = no top-k cut."""
    stop_token_ids: tuple[int, ...] = ()
    """Generation of a sample ends after it emits one of these (the stop token is kept)."""
    n: int = 1
    """Samples per prompt."""
    repetition_penalty: float = 1.0
    seed: int | None = None
    """Same seed, prompts and weights -> same samples."""
    max_new_tokens_each: tuple[int, ...] | None = None
    """Per prompt, the new tokens it may take (each in [1, max_new_tokens]); None:
    max_new_tokens for every prompt. The turns of multi-turn episodes each get what is left
    of their episode's budget."""
    first_token_candidates: tuple[int, ...] = ()
    """Token ids whose log p at each sample's first new token (under the raw logits) the
    completions report in `first_logprobs`: a judge's verdict read from the probabilities of
    "Yes" and "No", whichever token it then samples."""

    def __post_init__(self):
        problems = []
        if self.max_new_tokens < 1:
            problems.append(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            problems.append(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.n < 1:
            problems.append(f"n must be >= 1, got {self.n}")
        if self.repetition_penalty <= 0:
            problems.append(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        each = self.max_new_tokens_each
        if each is not None and not all(1 <= m <= self.max_new_tokens for m in each):
            problems.append(f"max_new_tokens_each must lie in [1, max_new_tokens="
                            f"{self.max_new_tokens}], got {min(each)}..{max(each)}")
        if any(t < 0 for t in self.first_token_candidates):
            problems.append(f"first_token_candidates must be token ids >= 0, got "
                            f"{self.first_token_candidates}")
        if problems:
            raise ValueError("invalid sampling params: " + "; ".join(problems))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def limits(self, prompts: int) -> list[int]:
        """The new tokens each of `prompts` prompts may take."""
        if self.max_new_tokens_each is None:
            return [self.max_new_tokens] * prompts
        if len(self.max_new_tokens_each) != prompts:
            raise ValueError(f"max_new_tokens_each has {len(self.max_new_tokens_each)} limits "
                             f"for {prompts} prompts")
        return list(self.max_new_tokens_each)

    def for_prompts(self, indices: list[int]) -> "SamplingParams":
        """These params for the prompts at `indices` of the call (an engine's share)."""
        if self.max_new_tokens_each is None:
            return self
        return dataclasses.replace(
            self, max_new_tokens_each=tuple(self.max_new_tokens_each[i] for i in indices))


@dataclasses.dataclass(frozen=True)
class Completion:
    prompt_index: int
    """Index of the prompt in the generate() call; a prompt's n samples are consecutive."""
    token_ids: list[int]
    logprobs: list[float]
    """log p(token) under the unprocessed model distribution, one per token."""
    finish_reason: str
    """'stop' (a stop token) or 'length' (max_new_tokens)."""
    routing: torch.Tensor | None = None
    """int16 [prompt + response - 1 tokens, layers, k]: the experts each token the engine fed
    went to (mixture-of-experts models, when asked for); the last response token was never
    fed."""
    sampled: tuple[bool, ...] | None = None
    """Per token: True where the engine sampled it (trained on; `logprobs` holds its
    logprob), False where an environment put it (an observation of a multi-turn episode:
    masked, logprob 0). None: the engine sampled every token."""
    first_logprobs: tuple[float, ...] | None = None
    """log p of each of SamplingParams.first_token_candidates at the first new token, under
    the raw logits; None when none were asked for."""


WeightStream = Iterable[list[tuple[str, torch.Tensor]]]
"""Buckets of (HF parameter name, full tensor); the engine may keep only its own shard. An
engine whose `copies_each_bucket` is True promises to be done with a bucket before it asks for
the next, so the producer may reuse the memory."""


ENGINE_PARTS = ("weights", "kv_cache")
"""What an engine's sleep frees and its wake allocates, in the order the weight sync wakes
them: the weights, then (after the sync has loaded them and freed its buffers) the KV cache,
so the two are never allocated beside the sync's transient memory."""


class RolloutEngine(Protocol):
    copies_each_bucket: bool
    """True when update_weights is done with a bucket before it asks for the next."""

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """len(prompts) * params.n completions, grouped by prompt."""

    def output_products(self, probe: torch.Tensor) -> tuple[int, torch.Tensor]:
        """(first vocabulary row this rank holds, its [rows, K] output-projection products
        with `probe`), as the engine computes them (rollout/projection.py)."""

    def update_weights(self, buckets: WeightStream) -> None:
        """Load new weights in place; every parameter of the model must arrive."""

    def sleep(self) -> None:
        """Free the weights' and the KV cache's memory for training (colocated mode)."""

    def wake(self, parts: tuple[str, ...] = ENGINE_PARTS) -> None:
        """Allocate `parts` (of ENGINE_PARTS) of what sleep() freed again; the weights must
        be updated before the next generate()."""

    def shutdown(self) -> None:
        ...


class EngineError(RuntimeError):
    """A rollout engine failed; the message names the engine and what it was doing."""
