"""What to read, how to tokenize and cut it, and what to do with records that are bad."""

from __future__ import annotations

import dataclasses

FORMATS = ("auto", "jsonl", "parquet", "hf")
TEMPLATES = ("auto", "chat", "plain")
BAD_RECORD_POLICIES = ("error", "skip")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DatasetSource:
    path: str
    """A JSONL file, a Parquet file, or a directory written by HF `datasets.save_to_disk`."""
    format: str = "auto"
    """'jsonl', 'parquet', 'hf', or 'auto': a directory is 'hf', '*.parquet' is 'parquet',
    anything else 'jsonl'."""
    split: str | None = None
    """Split of an HF DatasetDict directory; None takes its only split (or 'train')."""
    fields: dict[str, str] = dataclasses.field(default_factory=dict)
    """Our field name -> the column that holds it, e.g. {prompt: question, response: answer};
    unmapped fields are read from the column of the same name."""

    def __post_init__(self):
        if not self.path:
            raise ValueError("a dataset source needs a path")
        if self.format not in FORMATS:
            raise ValueError(f"unknown dataset format {self.format!r}; choose one of {FORMATS}")
        for ours, theirs in self.fields.items():
            if not isinstance(theirs, str) or not theirs:
                raise ValueError(f"fields.{ours} must name a column, got {theirs!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DataConfig:
    train: DatasetSource
    """The training records."""
    eval: DatasetSource | None = None
    """Held-out records; None holds out `eval_fraction` of the training records instead."""
    eval_fraction: float = 0.0
    """Share of the (shuffled) training records held out for evaluation when `eval` is None."""
    tokenizer: str | None = None
    """An HF tokenizer directory or a SentencePiece .model file; None uses the tokenizer saved
    with the model checkpoint (its `hf/` directory)."""
    template: str = "auto"
    """'chat' renders prompts with the tokenizer's chat template, 'plain' as
    ' Human: ... Assistant:', 'auto' picks 'chat' when the tokenizer has a template."""
    max_length: int = 512
    """Most tokens in one prompt + response sequence (and in one packed row)."""
    min_prompt_tokens: int | None = 1
    """Over-long records lose prompt tokens from the left first, down to this many, and only
    then response tokens from the right. None never cuts the prompt: a record whose prompt
    leaves no room for a response is then a bad record."""
    seed: int = 0
    """Seeds the eval hold-out and the order of every epoch."""
    on_bad_record: str = "error"
    """'error' stops at the first bad record; 'skip' drops it, counts it by reason and reports
    the counts (missing field, empty prompt, non-UTF-8 line, response cut to nothing, ...)."""

    def __post_init__(self):
        if self.template not in TEMPLATES:
            raise ValueError(f"unknown template {self.template!r}; choose one of {TEMPLATES}")
        if self.on_bad_record not in BAD_RECORD_POLICIES:
            raise ValueError(f"on_bad_record must be one of {BAD_RECORD_POLICIES}, got "
                             f"{self.on_bad_record!r}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if self.eval is not None and self.eval_fraction > 0:
            raise ValueError("give either an eval dataset or eval_fraction, not both")
        if self.max_length < 2:
            raise ValueError(f"max_length must be >= 2 (a prompt and a response token), got "
                             f"{self.max_length}")
        if self.min_prompt_tokens is not None and self.min_prompt_tokens < 1:
            raise ValueError(f"min_prompt_tokens must be >= 1 or None, got "
                             f"{self.min_prompt_tokens}")
