"""Image rows for vision-language models (Qwen2.5-VL): a row's `images` decoded, its image
placeholders turned into the model's vision tokens, and the pixels the vision tower reads.

A row carries its images in an `images` column: a list whose items are file paths (relative to
the dataset's directory, or absolute), encoded bytes, {"bytes": ..., "path": ...} dicts (how
Parquet and HF `datasets` store an image column; the bytes win when both are set) or PIL images
(what an HF `datasets` directory decodes them to). The prompt marks where each image goes, in
order: `<image>` in its text (or in a message's text), or a {"type": "image"} part of a
message's content list ({"type": "text", "text": ...} parts are its text).

Rendering goes through the project's prompt format unchanged: each placeholder becomes the
model's <|vision_start|><|image_pad|><|vision_end|> before the template renders the prompt (as
Qwen2.5-VL's own chat template renders an image part), and each image's single pad token then
becomes N of them, N = t*h*w / merge^2 of the grid the model's image processor (its
preprocessor_config.json, min/max pixels included) gives that image.

Refused as bad records (data.on_bad_record), naming the row and the image: a missing file,
bytes that do not decode, an image of more than `max_image_pixels` pixels, and placeholders
that do not match the images one to one.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from typing import TYPE_CHECKING, Any

from megarlhf.data.config import DatasetSource
from megarlhf.data.prompts import Prompt
from megarlhf.data.records import KIND_FIELDS, MESSAGES, TEXT_FIELDS, Record, field_columns, \
    lookup, read_records
from megarlhf.data.report import BadRecords
from megarlhf.data.templates import PromptFormat

if TYPE_CHECKING:
    import torch

IMAGES = "images"
"""The column that holds a row's images."""
IMAGE_MARKER = "<image>"
"""An image's place in a prompt's text."""
DEFAULT_MAX_IMAGE_PIXELS = 89_478_485
"""PIL's own decompression-bomb threshold (Image.MAX_IMAGE_PIXELS): far above what any image
processor keeps (Qwen2.5-VL's max_pixels is 12.8M), low enough that one bad file cannot fill
the launching process's memory."""
PREPROCESSOR_CONFIG = "preprocessor_config.json"
VISION_TOKEN_KEYS = ("vision_start_token_id", "image_token_id", "vision_end_token_id")
"""config.json's ids of the tokens around and inside an image, in the order they appear."""


class ImageError(Exception):
    """A bad image row: `reason` is the counted category, `detail` names the image."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason)
        self.reason, self.detail = reason, detail


@dataclasses.dataclass(frozen=True)
class ImageInputs:
    """What the vision tower reads for one row's images, in placeholder order."""
    pixel_values: torch.Tensor
    """[patches, channels * temporal_patch * patch^2], the image processor's output."""
    grid_thw: torch.Tensor
    """[images, 3] (temporal, height, width) patches per image, long."""
    sizes: tuple[tuple[int, int], ...]
    """(width, height) of each image as read, before the processor resized it."""
    tokens: tuple[int, ...]
    """Image pad tokens per image in the rendered ids: t*h*w / merge^2."""
    token_id: int
    """The image pad token (the model's image_token_id)."""


@dataclasses.dataclass(frozen=True)
class ImageExample:
    """A record rendered with its images: what SFT, DPO and rollouts read."""
    record: Record
    """The row as read (where, ground truth, data source, metadata, margin, label)."""
    prompt: tuple[int, ...]
    """Token ids, each image's pad token repeated as often as the image has tokens."""
    responses: tuple[tuple[int, ...], ...]
    images: ImageInputs | None
    """None for a row without images."""


def open_images(value: Any, base_dir: str, *, max_image_pixels: int) -> list:
    """The row's `images` value as RGB PIL images; ImageError naming the image otherwise."""
    if not isinstance(value, (list, tuple)):
        raise ImageError(f"field '{IMAGES}' is not a list", type(value).__name__)
    return [_open_image(item, f"{IMAGES}[{i}]", base_dir, max_image_pixels)
            for i, item in enumerate(value)]


def _open_image(item: Any, name: str, base_dir: str, max_pixels: int):
    from PIL import Image

    if isinstance(item, Image.Image):
        return _checked(item, name, max_pixels)
    if isinstance(item, dict):  # {"bytes": ..., "path": ...}: bytes first, as `datasets` does
        item = item.get("bytes") or item.get("path")
    if isinstance(item, (bytes, bytearray)):
        source, label = io.BytesIO(item), f"{name} ({len(item)} bytes)"
    elif isinstance(item, str) and item:
        source = item if os.path.isabs(item) else os.path.join(base_dir, item)
        label = f"{name} ({source})"
        if not os.path.isfile(source):
            raise ImageError("missing image file", f"{label} does not exist")
    else:
        raise ImageError("malformed image", f"{name} is neither a path, bytes nor "
                                            f"{{bytes, path}}: {type(item).__name__}")
    try:
        image = Image.open(source)
    except Image.DecompressionBombError as e:
        raise ImageError("image too large", f"{label}: {e}") from None
    except (OSError, SyntaxError, ValueError) as e:  # PIL's errors for data it cannot read
        raise ImageError("undecodable image", f"{label}: {e}") from None
    return _checked(image, label, max_pixels)


def _checked(image, label: str, max_pixels: int):
    """`image` decoded as RGB, once its size (read from the header, before decoding) is
    within `max_pixels`."""
    width, height = image.size
    if width * height > max_pixels:
        raise ImageError("image too large", f"{label} is {width}x{height} = {width * height} "
                                            f"pixels, above max_image_pixels={max_pixels}")
    try:
        return image.convert("RGB")
    except (OSError, SyntaxError, ValueError) as e:  # a header that decodes, data that does not
        raise ImageError("undecodable image", f"{label}: {e}") from None


def mark_images(value: Any, marker: str) -> Any:
    """A prompt-bearing value (text, or a message list) with each image placeholder replaced
    by `marker` and content lists joined into text; other values are returned as they are
    (the record reader judges them)."""
    if isinstance(value, str):
        return value.replace(IMAGE_MARKER, marker)
    if not isinstance(value, list):
        return value
    return [{**m, "content": _content(m["content"], marker)}
            if isinstance(m, dict) and "content" in m else m for m in value]


def _content(content: Any, marker: str) -> Any:
    if isinstance(content, str):
        return content.replace(IMAGE_MARKER, marker)
    if not isinstance(content, list):
        return content
    text = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image":
            text.append(marker)
        elif kind == "text" and isinstance(part.get("text"), str):
            text.append(part["text"].replace(IMAGE_MARKER, marker))
        else:
            raise ImageError("unsupported content part", f"{str(kind or part)[:40]}: only "
                             f"{{type: text, text}} and {{type: image}} parts are read")
    return "".join(text)


def _set(row: dict, path: str, value: Any) -> dict:
    """`row` (copied along the way) with `value` at `path`, the place `records.lookup` reads."""
    if path in row or "." not in path:
        return {**row, path: value}
    head, rest = path.split(".", 1)
    return {**row, head: _set(row[head], rest, value)}


class VisionFormat:
    def __init__(self, model_dir: str, fmt: PromptFormat, *,
                 max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS):
        """The image processor and vision tokens of the HF model in `model_dir` (its
        preprocessor_config.json and config.json), rendering prompts through `fmt` (whose
        tokenizer must be the model's)."""
        from transformers import Qwen2VLImageProcessorPil

        if max_image_pixels < 1:
            raise ValueError(f"max_image_pixels must be >= 1, got {max_image_pixels}")
        if not os.path.isfile(os.path.join(model_dir, PREPROCESSOR_CONFIG)):
            raise ValueError(f"{model_dir} has no {PREPROCESSOR_CONFIG}, which sets how images "
                             f"become patches; copy it from the HF model")
        self.fmt, self.max_image_pixels = fmt, max_image_pixels
        self.processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
        self.start_id, self.image_id, self.end_id = _vision_token_ids(model_dir, fmt)
        self.marker = "".join(fmt.tokenizer.decode([token]) for token in
                              (self.start_id, self.image_id, self.end_id))

    def inputs(self, images: list) -> ImageInputs:
        """The processor's pixels and grids for `images` (RGB PIL images)."""
        out = self.processor(images=images, return_tensors="pt")
        grid = out["image_grid_thw"].long()
        merge = self.processor.merge_size
        return ImageInputs(pixel_values=out["pixel_values"], grid_thw=grid,
                           sizes=tuple(image.size for image in images),
                           tokens=tuple(int(n) // merge ** 2 for n in grid.prod(1)),
                           token_id=self.image_id)

    def expand(self, ids: list[int], tokens: tuple[int, ...]) -> list[int]:
        """`ids` with the i-th image pad token repeated tokens[i] times; ImageError when the
        pads are not one per image."""
        pads = ids.count(self.image_id)
        if pads != len(tokens):
            raise ImageError("image count mismatch", f"the prompt has {pads} image "
                             f"placeholder(s) ({IMAGE_MARKER} or {{type: image}}), "
                             f"'{IMAGES}' holds {len(tokens)} image(s)")
        out, i = [], 0
        for token in ids:
            if token == self.image_id:
                out += [token] * tokens[i]
                i += 1
            else:
                out.append(token)
        return out


def _vision_token_ids(model_dir: str, fmt: PromptFormat) -> tuple[int, int, int]:
    """config.json's vision start, image and vision end ids, each checked to be one token of
    the tokenizer (a tokenizer without them would split the marker into text pieces)."""
    path = os.path.join(model_dir, "config.json")
    config = {}
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    missing = [key for key in VISION_TOKEN_KEYS if not isinstance(config.get(key), int)]
    if missing:
        raise ValueError(f"{path} sets no {', '.join(missing)}: not a vision-language model's "
                         f"config")
    ids = tuple(config[key] for key in VISION_TOKEN_KEYS)
    for key, token in zip(VISION_TOKEN_KEYS, ids):
        text = fmt.tokenizer.decode([token])
        if fmt.tokenizer.encode(text) != [token]:
            raise ValueError(f"{fmt.tokenizer} has no token {token} ({key} of {path}) that "
                             f"text encodes to (it decodes to {text!r}); use the model's own "
                             f"tokenizer")
    return ids


def read_image_examples(source: DatasetSource, kind: str, vision: VisionFormat,
                        bad: BadRecords) -> list[ImageExample]:
    """The good records of `source` (a `kind` of records.KIND_FIELDS), rendered with their
    images; bad ones (bad images among them) go to `bad`. Nothing is cut to a length: an
    image's tokens cannot be cut, so fitting is the caller's to check."""
    columns = field_columns(source, kind)
    prompt_paths = [columns[name] for name in KIND_FIELDS[kind] if name == "prompt"
                    or name in TEXT_FIELDS] + ([MESSAGES] if kind == "prompt" else [])
    base_dir = source.path if os.path.isdir(source.path) else \
        os.path.dirname(os.path.abspath(source.path))
    images: dict[str, ImageInputs | None] = {}

    def prepare(where: str, row: dict) -> dict | None:
        try:
            given = row.get(IMAGES)
            opened = [] if given is None else open_images(
                given, base_dir, max_image_pixels=vision.max_image_pixels)
            images[where] = vision.inputs(opened) if opened else None
            row = {k: v for k, v in row.items() if k != IMAGES}
            for path in prompt_paths:
                if lookup(row, path) is not None:
                    row = _set(row, path, mark_images(lookup(row, path), vision.marker))
            return row
        except ImageError as e:
            bad.add(where, e.reason, e.detail)
            return None

    out = []
    for rec in read_records(source, kind, bad, prepare=prepare):
        try:
            out.append(_render(rec, images[rec.where], vision))
        except ImageError as e:
            bad.add(rec.where, e.reason, e.detail)
    return out


def _render(rec: Record, images: ImageInputs | None, vision: VisionFormat) -> ImageExample:
    tokens = () if images is None else images.tokens
    prompt = vision.expand(vision.fmt.prompt(rec.prompt), tokens)
    responses = tuple(tuple(vision.fmt.response(rec.prompt, r)) for r in rec.responses)
    if any(vision.image_id in r for r in responses):
        raise ImageError("image placeholder in a response", "images belong in the prompt")
    return ImageExample(record=rec, prompt=tuple(prompt), responses=responses, images=images)


def load_image_prompts(source: DatasetSource, vision: VisionFormat, *,
                       on_bad_record: str = "error", bad_field: str = "on_bad_record"
                       ) -> tuple[list[Prompt], dict]:
    """`prompts.load_prompts` for rows with images: the usable prompts (each with its
    `images`) and the read report."""
    bad = BadRecords(on_bad_record, field=bad_field)
    prompts = [Prompt(ids=ex.prompt, where=ex.record.where,
                      ground_truth=ex.record.ground_truth, data_source=ex.record.data_source,
                      metadata=ex.record.metadata, text=ex.record.prompt, images=ex.images)
               for ex in read_image_examples(source, "prompt", vision, bad)]
    report = {"path": source.path, "kept": len(prompts), "template": vision.fmt.name,
              **bad.summary()}
    if not prompts:
        raise ValueError(f"{source.path} has no usable prompts: {report}")
    return prompts, report


def describe(images: ImageInputs) -> str:
    """A row's images for a preview: each one's size as read, its grid and its tokens."""
    return ", ".join(f"{w}x{h} -> grid {'x'.join(map(str, grid))} = {n} tokens"
                     for (w, h), grid, n in zip(images.sizes, images.grid_thw.tolist(),
                                                images.tokens))


def collapse(ids: tuple[int, ...], images: ImageInputs) -> list[int]:
    """`ids` with each image's run of pad tokens cut to one, for showing a prompt as text."""
    return [t for i, t in enumerate(ids)
            if not (t == images.token_id and i > 0 and ids[i - 1] == t)]
