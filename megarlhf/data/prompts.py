"""Rollout prompts as token ids: the JSONL file the PPO loop reads ({"prompt_ids": [...]} per
line), made from a prompt dataset with the same prompt format SFT and RM trained on."""

from __future__ import annotations

import json

from megarlhf.data.config import DatasetSource
from megarlhf.data.encode import encode_records
from megarlhf.data.records import read_records
from megarlhf.data.report import BadRecords
from megarlhf.data.templates import PromptFormat
from megarlhf.data.tokenizer import Tokenizer


def write_prompt_ids(source: DatasetSource, tokenizer: Tokenizer, out_path: str, *,
                     max_length: int, template: str = "auto",
                     on_bad_record: str = "error") -> dict:
    """Write the prompts of `source` (prompts longer than `max_length` keep their last
    tokens); returns the read report (kept, skipped by reason)."""
    bad = BadRecords(on_bad_record)
    examples = encode_records(read_records(source, "prompt", bad),
                              PromptFormat(tokenizer, template), max_length=max_length,
                              min_prompt_tokens=None, bad=bad)
    if not examples:
        raise ValueError(f"{source.path} has no usable prompts: {bad.summary()}")
    with open(out_path, "w") as f:
        for ex in examples:
            f.write(json.dumps({"prompt_ids": list(ex.prompt)}) + "\n")
    return {"path": source.path, "kept": len(examples), **bad.summary()}
