"""Text records from JSONL, Parquet or an HF `datasets` directory, with field names mapped.

Four kinds of record: 'prompt' (prompts alone, for rollouts), 'sft' (prompt + response),
'pairwise' (prompt + chosen + rejected, optionally a per-pair margin) and 'unpaired' (prompt +
completion + a desirable/undesirable label, for KTO). A prompt is text or a list of {role,
content} messages. A response is text, or (the conversational layout of preference datasets)
a message list ending with it as an assistant message, whose earlier messages are the prompt:
they may replace the prompt field, and must equal it (and each other) where both are given.
Anything else is a bad record, handled by `BadRecords`.

A field maps to a column, or with a dotted path to a value inside one (`reward_model.
ground_truth` reads verl's rows as they are). Prompt records also carry what RL with verifiable
rewards needs: an optional ground truth and data source, the row's other columns as metadata
(handed to the reward function), and token ids when the row is already tokenized
(`prompt_ids`, as `megarlhf data --write-cache` writes them). A prompt row without a `prompt`
column may hold its conversation under `messages`.
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Callable, Iterator

from megarlhf.data.config import DatasetSource
from megarlhf.data.report import BadRecords

KIND_FIELDS = {
    "prompt": ("prompt",),
    "sft": ("prompt", "response"),
    "pairwise": ("prompt", "chosen", "rejected"),
    "unpaired": ("prompt", "completion", "label"),
}
TEXT_FIELDS = ("response", "chosen", "rejected", "completion")
"""The fields that hold a response's text (the others: the prompt and a label)."""
OPTIONAL_FIELDS = {"prompt": ("ground_truth", "data_source"), "sft": (),
                   "pairwise": ("margin",), "unpaired": ()}
PROMPT_IDS = "prompt_ids"
MESSAGES = "messages"
ROLES = ("system", "user", "assistant", "tool")
"""Roles of prompt messages ('tool': a tool's result, as in few-shot tool-calling prompts)."""

Message = tuple[str, str]
"""(role, content)."""


@dataclasses.dataclass(frozen=True)
class Record:
    where: str
    """Source location, 'file:line' or 'file:row N', for error messages and skip reports."""
    prompt: str | tuple[Message, ...]
    responses: tuple[str, ...]
    """() for prompts, (response,) for SFT, (chosen, rejected) for pairs."""
    margin: float | None = None
    """Pairwise only: how much more the chosen response should score, if the data says."""
    label: bool | None = None
    """Unpaired only: whether the completion is desirable."""
    ground_truth: Any = None
    """Prompt records: what the reward function checks a response against, if the data says."""
    data_source: str | None = None
    """Prompt records: which dataset (or task) the row comes from; routes rewards, splits
    validation metrics."""
    metadata: dict = dataclasses.field(default_factory=dict)
    """Prompt records: the row's columns that are not one of the fields above."""
    prompt_ids: tuple[int, ...] | None = None
    """Prompt records: the prompt's token ids when the row holds them (then `prompt` may be
    empty)."""


class _Bad(Exception):
    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason, self.detail = reason, detail


def read_records(source: DatasetSource, kind: str, bad: BadRecords, *,
                 prepare: Callable[[str, dict], dict | None] | None = None) -> list[Record]:
    """All good records of `source`, in file order; bad ones go to `bad`. `prepare(where,
    row)` turns each row into the row read, or None for a bad row it reported to `bad`
    (images.py: a row's images taken out, its placeholders marked)."""
    columns = field_columns(source, kind)
    records = []
    for where, row in _rows(source, bad):
        if prepare is not None and (row := prepare(where, row)) is None:
            continue
        try:
            if prepare is None and row.get("images"):
                # Read as text, the images would be dropped and their placeholders trained
                # on as words.
                raise _Bad("images for a text-only model", "the row has 'images'; the model "
                           "reads text only: use a vision-language model or drop the column")
            records.append(_record(where, row, kind, columns))
        except _Bad as e:
            bad.add(where, e.reason, e.detail)
    return records


def field_columns(source: DatasetSource, kind: str) -> dict[str, str]:
    """Our field name -> column name for `kind` records; ValueError on a mapping of a field
    that `kind` records do not have."""
    if kind not in KIND_FIELDS:
        raise ValueError(f"unknown record kind {kind!r}; choose one of {sorted(KIND_FIELDS)}")
    known = KIND_FIELDS[kind] + OPTIONAL_FIELDS[kind]
    unknown = sorted(set(source.fields) - set(known))
    if unknown:
        raise ValueError(f"fields {unknown} are not fields of {kind} records; map some of "
                         f"{list(known)}")
    return {name: source.fields.get(name, name) for name in known}


def _record(where: str, row: dict, kind: str, columns: dict[str, str]) -> Record:
    def get(name: str):
        value = lookup(row, columns[name])
        if value is None:
            raise _Bad(f"missing field '{columns[name]}'", f"the {name} of a {kind} record")
        return value

    if kind == "prompt":
        return _prompt_record(where, row, columns)
    given = lookup(row, columns["prompt"])
    prompt = None if given is None else _prompt(given)
    responses, contexts = [], {}
    for name in KIND_FIELDS[kind]:
        if name not in TEXT_FIELDS:
            continue
        text, context = _response(get(name), columns[name], conversational=kind == "pairwise")
        if not text.strip():
            raise _Bad(f"empty {name}")
        responses.append(text)
        if context:
            contexts[name] = context
    prompt = _conversation_prompt(prompt, contexts, columns, kind)
    margin = None
    if "margin" in OPTIONAL_FIELDS[kind] and lookup(row, columns["margin"]) is not None:
        margin = lookup(row, columns["margin"])
        if isinstance(margin, bool) or not isinstance(margin, (int, float)):
            raise _Bad(f"field '{columns['margin']}' is not a number", repr(margin)[:60])
        margin = float(margin)
    label = _label(get("label"), columns["label"]) if kind == "unpaired" else None
    return Record(where=where, prompt=prompt, responses=tuple(responses), margin=margin,
                  label=label)


def _response(value, column: str, *, conversational: bool) -> tuple[str, tuple[Message, ...]]:
    """A response's text and the conversation before it: none for text; a message list (the
    conversational layout of chosen/rejected, read where `conversational`) ends with the
    response, an assistant message, and what comes before it is the prompt."""
    if not (conversational and isinstance(value, list)):
        return _text(value, column), ()
    messages = _messages(value)
    if not messages or messages[-1][0] != "assistant":
        raise _Bad(f"field '{column}' does not end with an assistant message")
    return messages[-1][1], messages[:-1]


def _conversation_prompt(prompt: str | tuple[Message, ...] | None,
                         contexts: dict[str, tuple[Message, ...]], columns: dict[str, str],
                         kind: str) -> str | tuple[Message, ...]:
    """The prompt field's value (None: the row has none), or the conversation the responses
    continue when they hold it; where both (or both responses) give one, they must agree."""
    given = sorted(set(contexts.values()))
    if len(given) > 1:
        raise _Bad("prompt differs between " + " and ".join(
            f"'{columns[name]}'" for name in contexts), "their messages before the last differ")
    if prompt is None:
        if not given:
            raise _Bad(f"missing field '{columns['prompt']}'", f"the prompt of a {kind} record")
        if not any(content.strip() for _, content in given[0]):
            raise _Bad("empty prompt")
        return given[0]
    as_messages = (("user", prompt),) if isinstance(prompt, str) else prompt
    if given and given[0] != as_messages:
        raise _Bad(f"prompt differs between '{columns['prompt']}' and "
                   f"'{columns[next(iter(contexts))]}'",
                   "the conversation before the response is not the prompt")
    return prompt


def _label(value, column: str) -> bool:
    """true/false, or 1/0 as some datasets write them."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise _Bad(f"field '{column}' is not true/false", repr(value)[:60])


def _prompt_record(where: str, row: dict, columns: dict[str, str]) -> Record:
    ids = row.get(PROMPT_IDS)
    if ids is not None:
        if not (isinstance(ids, list) and ids and all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)):
            raise _Bad(f"field '{PROMPT_IDS}' is not a non-empty list of token ids")
        ids = tuple(ids)
    column = columns["prompt"]
    if lookup(row, column) is None and column == "prompt" and row.get(MESSAGES) is not None:
        column = MESSAGES  # the chat-dataset layout: {"messages": [...]}
    value = lookup(row, column)
    if value is None and ids is None:
        raise _Bad(f"missing field '{columns['prompt']}'",
                   f"a prompt record needs it (or '{MESSAGES}', or '{PROMPT_IDS}')")
    prompt = "" if value is None else _prompt(value)
    source = lookup(row, columns["data_source"])
    if source is not None and not isinstance(source, str):
        raise _Bad(f"field '{columns['data_source']}' is not text", type(source).__name__)
    used = {path.split(".")[0] for path in (column, columns["ground_truth"],
                                            columns["data_source"])} | {PROMPT_IDS}
    metadata = {k: v for k, v in row.items() if k not in used}
    return Record(where=where, prompt=prompt, responses=(),
                  ground_truth=lookup(row, columns["ground_truth"]), data_source=source,
                  metadata=metadata, prompt_ids=ids)


def lookup(row: dict, path: str):
    """The value at `path` in `row`: a column, or with dots a value inside nested columns
    (a column whose name holds the dots itself comes first); None where there is none."""
    if path in row:
        return row[path]
    value = row
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return None
        value = value[part]
    return value


def _text(value, column: str) -> str:
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            raise _Bad("invalid UTF-8", f"field '{column}'") from None
    if not isinstance(value, str):
        raise _Bad(f"field '{column}' is not text", type(value).__name__)
    return value


def _messages(value: list) -> tuple[Message, ...]:
    messages = []
    for m in value:
        if not (isinstance(m, dict) and m.get("role") in ROLES
                and isinstance(m.get("content"), str)):
            raise _Bad("malformed messages",
                       f"each message needs a role in {ROLES} and text content")
        messages.append((m["role"], m["content"]))
    return tuple(messages)


def _prompt(value) -> str | tuple[Message, ...]:
    if isinstance(value, list):
        messages = _messages(value)
        if not any(content.strip() for _, content in messages):
            raise _Bad("empty prompt")
        return messages
    text = _text(value, "prompt")
    if not text.strip():
        raise _Bad("empty prompt")
    return text


def _format(source: DatasetSource) -> str:
    if source.format != "auto":
        return source.format
    if os.path.isdir(source.path):
        return "hf"
    return "parquet" if source.path.endswith(".parquet") else "jsonl"


def _rows(source: DatasetSource, bad: BadRecords) -> Iterator[tuple[str, dict]]:
    if not os.path.exists(source.path):
        raise ValueError(f"dataset {source.path} does not exist")
    fmt = _format(source)
    if fmt == "jsonl":
        yield from _jsonl_rows(source.path, bad)
    elif fmt == "parquet":
        yield from _parquet_rows(source.path)
    else:
        yield from _hf_rows(source.path, source.split)


def _jsonl_rows(path: str, bad: BadRecords) -> Iterator[tuple[str, dict]]:
    # Bytes in, decoded per line: one bad line is one bad record, not a failed file.
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
            except UnicodeDecodeError:
                bad.add(where, "invalid UTF-8")
                continue
            except json.JSONDecodeError as e:
                bad.add(where, "invalid JSON", e.msg)
                continue
            if not isinstance(row, dict):
                bad.add(where, "not a JSON object", type(row).__name__)
                continue
            yield where, row


def _parquet_rows(path: str) -> Iterator[tuple[str, dict]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"reading {path} needs pyarrow, which is not installed: "
                         f"pip install pyarrow (or convert the data to JSONL)") from None
    index = 0
    for batch in pq.ParquetFile(path).iter_batches():
        for row in batch.to_pylist():
            yield f"{path}:row {index}", row
            index += 1


def _hf_rows(path: str, split: str | None) -> Iterator[tuple[str, dict]]:
    try:
        import datasets
    except ImportError:
        raise ValueError(f"reading the HF datasets directory {path} needs `datasets`, which "
                         f"is not installed: pip install datasets (or export it to JSONL)"
                         ) from None
    data = datasets.load_from_disk(path)
    if isinstance(data, datasets.DatasetDict):
        splits = sorted(data)
        if split is None:
            split = splits[0] if len(splits) == 1 else "train" if "train" in data else None
        if split not in data:
            raise ValueError(f"{path} has splits {splits}; choose one with split: NAME")
        data, path = data[split], f"{path}[{split}]"
    elif split is not None:
        raise ValueError(f"{path} holds a single dataset without splits; remove split: {split}")
    for index, row in enumerate(data):
        yield f"{path}:row {index}", row
