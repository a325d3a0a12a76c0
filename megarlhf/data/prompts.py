"""Rollout prompts: a prompt dataset (JSONL, Parquet or an HF `datasets` directory) read by the
same pipeline SFT and RM use, tokenized once in the launching process with the actor's tokenizer
and prompt format, each prompt keeping its ground truth, data source and metadata for the reward
function.

Rows already tokenized (`{"prompt_ids": [...]}`) are taken as they are. `write_prompt_cache`
writes such a file (what `megarlhf data --write-cache` makes), with a sidecar recording its
checksum and the tokenizer it was made with; reading a file that has the sidecar verifies both,
so an edited cache or one made for another tokenizer is refused instead of trained on.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Callable

from megarlhf.data.config import DatasetSource
from megarlhf.data.records import PROMPT_IDS, read_records
from megarlhf.data.report import BadRecords
from megarlhf.data.templates import PromptFormat
from megarlhf.data.tokenizer import Tokenizer, tokenizer_fingerprint
from megarlhf.integrity import file_sha256

CACHE_SIDECAR = ".megarlhf.json"
"""Appended to a prompt cache's path: its checksum and the tokenizer it was made with."""


@dataclasses.dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]
    where: str
    """'file:line' or 'file:row N', for messages about this prompt."""
    ground_truth: Any = None
    data_source: str | None = None
    metadata: dict = dataclasses.field(default_factory=dict)
    text: str | tuple[tuple[str, str], ...] | None = dataclasses.field(default=None,
                                                                        compare=False)
    """The prompt before rendering (text, or (role, content) messages); None for a
    pre-tokenized row. An environment's episode starts from it. Not part of a prompt's
    identity (its ids are): a prompt cache keeps only the ids."""
    images: Any = dataclasses.field(default=None, compare=False)
    """A vision-language prompt's images (images.ImageInputs: pixels, grids, tokens per
    image; images.py reads them), whose image tokens its ids hold; None for text. Left out
    of comparisons (tensors do not compare to a bool); the ids hold each image's token
    count."""


def load_prompts(source: DatasetSource, tokenizer: Callable[[], Tokenizer] | None, *,
                 tokenizer_path: str | None = None, template: str = "auto",
                 on_bad_record: str = "error", bad_field: str = "on_bad_record",
                 format_options: dict | None = None) -> tuple[list[Prompt], dict]:
    """The usable prompts of `source` and the read report (kept, skipped by reason, prompt
    format). `tokenizer` builds the tokenizer (called only if some row holds text);
    `tokenizer_path` is checked against a cache's sidecar; `bad_field` is the config field
    named in a bad record's error; `format_options`: PromptFormat's keyword arguments (tools,
    a chat template)."""
    _verify_cache(source.path, tokenizer_path)
    bad = BadRecords(on_bad_record, field=bad_field)
    fmt, prompts = None, []
    for rec in read_records(source, "prompt", bad):
        ids = rec.prompt_ids
        if ids is None:
            if tokenizer is None:
                raise ValueError(f"{rec.where}: the prompt is text, but no tokenizer is known "
                                 f"to tokenize it; set tokenizer=HF_DIR")
            fmt = fmt or PromptFormat(tokenizer(), template, **(format_options or {}))
            ids = tuple(fmt.prompt(rec.prompt))
            if not ids:
                bad.add(rec.where, "empty prompt", "no tokens")
                continue
        prompts.append(Prompt(ids=ids, where=rec.where, ground_truth=rec.ground_truth,
                              data_source=rec.data_source, metadata=rec.metadata,
                              text=rec.prompt if rec.prompt_ids is None else None))
    report = {"path": source.path, "kept": len(prompts),
              "template": fmt.name if fmt else "pre-tokenized", **bad.summary()}
    if not prompts:
        raise ValueError(f"{source.path} has no usable prompts: {report}")
    return prompts, report


def prompt_row(prompt: Prompt) -> dict:
    """`prompt` as a pre-tokenized row that reads back as the same Prompt."""
    row = {PROMPT_IDS: list(prompt.ids)}
    if prompt.ground_truth is not None:
        row["ground_truth"] = prompt.ground_truth
    if prompt.data_source is not None:
        row["data_source"] = prompt.data_source
    return {**prompt.metadata, **row}


def write_prompt_cache(prompts: list[Prompt], path: str, *, tokenizer_path: str | None,
                       source: str) -> str:
    """Write `prompts` as pre-tokenized JSONL at `path` (through a temporary sibling), with
    its sidecar; returns the file's sha256. An existing `path` is replaced only if it is a
    cache this function wrote (it has the sidecar)."""
    with_images = next((p.where for p in prompts if p.images is not None), None)
    if with_images is not None:
        raise ValueError(f"a prompt cache holds token ids only, and {with_images} has images; "
                         f"point the run at the dataset itself")
    sidecar = path + CACHE_SIDECAR
    if os.path.exists(path) and not os.path.isfile(sidecar):
        raise ValueError(f"{path} exists and is not a prompt cache megarlhf wrote (no "
                         f"{os.path.basename(sidecar)} beside it); choose another path")
    digest = hashlib.sha256()
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for prompt in prompts:
            line = (json.dumps(prompt_row(prompt), ensure_ascii=False) + "\n")
            digest.update(line.encode("utf-8"))
            f.write(line)
    meta = {"sha256": digest.hexdigest(), "rows": len(prompts), "source": source,
            "tokenizer": _fingerprint(tokenizer_path)}
    with open(sidecar + ".tmp", "w") as f:
        json.dump(meta, f, indent=1)
    os.replace(tmp, path)
    os.replace(sidecar + ".tmp", sidecar)
    return meta["sha256"]


def _verify_cache(path: str, tokenizer_path: str | None) -> None:
    sidecar = path + CACHE_SIDECAR
    if not os.path.isfile(sidecar) or not os.path.isfile(path):
        return
    with open(sidecar) as f:
        meta = json.load(f)
    if file_sha256(path) != meta.get("sha256"):
        raise ValueError(f"prompt cache {path} does not match the checksum it was written with "
                         f"({os.path.basename(sidecar)}): it was changed or cut short; write it "
                         f"again with `megarlhf data --write-cache`")
    mine = _fingerprint(tokenizer_path)
    if mine is not None and meta.get("tokenizer") is not None and mine != meta["tokenizer"]:
        raise ValueError(f"prompt cache {path} was tokenized with another tokenizer than this "
                         f"run's ({tokenizer_path}); write it again with `megarlhf data "
                         f"--write-cache`, or point prompts at the text dataset")


def _fingerprint(tokenizer_path: str | None) -> str | None:
    if tokenizer_path is None or not os.path.exists(tokenizer_path):
        return None
    return tokenizer_fingerprint(tokenizer_path)


