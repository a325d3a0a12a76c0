"""A configured dataset end to end: read records, tokenize and fit them, hold out eval."""

from __future__ import annotations

import dataclasses

from megarlhf.data.config import DataConfig, DatasetSource
from megarlhf.data.encode import Example, encode_records
from megarlhf.data.order import split_eval
from megarlhf.data.records import read_records
from megarlhf.data.report import BadRecords
from megarlhf.data.templates import PromptFormat
from megarlhf.data.tokenizer import Tokenizer


@dataclasses.dataclass(frozen=True)
class Examples:
    train: list[Example]
    eval: list[Example]
    report: dict
    """Per source: records kept, skipped (by reason) and truncated; and the prompt format."""


def load_examples(cfg: DataConfig, kind: str, tokenizer: Tokenizer, *,
                  default_margin: float = 0.0) -> Examples:
    fmt = PromptFormat(tokenizer, cfg.template)

    def load(source: DatasetSource) -> tuple[list[Example], dict]:
        bad = BadRecords(cfg.on_bad_record)
        records = read_records(source, kind, bad)
        examples = encode_records(records, fmt, max_length=cfg.max_length,
                                  min_prompt_tokens=cfg.min_prompt_tokens, bad=bad,
                                  default_margin=default_margin)
        summary = {"path": source.path, "kept": len(examples), **bad.summary()}
        if not examples:
            raise ValueError(f"{source.path} has no usable {kind} records: {summary}")
        return examples, summary

    train, train_report = load(cfg.train)
    report = {"template": fmt.name, "train": train_report}
    if cfg.eval is not None:
        held_out, report["eval"] = load(cfg.eval)
    else:
        train, held_out = split_eval(train, cfg.eval_fraction, cfg.seed)
        report["eval"] = {"held_out_of_train": len(held_out)}
    return Examples(train=train, eval=held_out, report=report)
