"""Image rows for Qwen2.5-VL (issue 66, megarlhf/data/images.py): images drawn here, read from
paths, bytes and Parquet's {bytes, path} dicts, placed by `<image>` markers and {type: image}
parts, rendered against ids spelled out by hand and pixels from the image processor itself;
bad images refused naming the row and the image; the `megarlhf data` preview's image lines."""

from __future__ import annotations

import json

import pytest
import torch

from megarlhf.data.config import DatasetSource
from megarlhf.data.report import BadRecordError, BadRecords

VISION_TOKENS = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"]
# Patches of 14 px merged 2x2: an image is (h/28)*(w/28) tokens once resized to multiples of
# 28 px between these bounds (4 and 20 tokens).
MIN_PIXELS, MAX_PIXELS = 4 * 28 * 28, 20 * 28 * 28


def _draw(path, size, digits: str):
    """A canvas of `size` (w, h) with `digits` written on it, saved as PNG."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", size, (250, 240, 200))
    ImageDraw.Draw(image).text((4, 4), digits, fill=(20, 20, 120))
    image.save(path)
    return str(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """What a Qwen2.5-VL directory holds for the data side: a tokenizer with the vision tokens
    (the ChatML test tokenizer plus them), config.json naming their ids, and the image
    processor's preprocessor_config.json."""
    import transformers

    from tests import chat_tokenizer

    path = tmp_path_factory.mktemp("vl") / "hf"
    chat_tokenizer.save(str(path))
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(str(path))
    tok.add_special_tokens({"additional_special_tokens": chat_tokenizer.SPECIALS[1:]
                            + VISION_TOKENS})
    tok.save_pretrained(str(path))
    start, image, end = tok.convert_tokens_to_ids(VISION_TOKENS)
    transformers.Qwen2_5_VLConfig(
        text_config={"vocab_size": len(tok)}, vision_config={"depth": 1},
        image_token_id=image, vision_start_token_id=start,
        vision_end_token_id=end).save_pretrained(str(path))
    transformers.Qwen2VLImageProcessorPil(min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS
                                          ).save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """a.png fits as it is (84x56: 2x3 tokens); b.png (200x150) is resized down to fit."""
    d = tmp_path_factory.mktemp("img")
    return {"dir": d, "a": _draw(d / "a.png", (84, 56), "12"),
            "b": _draw(d / "b.png", (200, 150), "345")}


def _vision(model_dir, **kwargs):
    from megarlhf.data.images import VisionFormat
    from megarlhf.data.templates import PromptFormat
    from megarlhf.data.tokenizer import HFTokenizer

    return VisionFormat(model_dir, PromptFormat(HFTokenizer(model_dir), "chat"), **kwargs)


def _processor(model_dir, paths):
    """The image processor's own output for the image files at `paths`."""
    from PIL import Image
    from transformers import Qwen2VLImageProcessorPil

    out = Qwen2VLImageProcessorPil.from_pretrained(model_dir)(
        images=[Image.open(p) for p in paths], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), str(path))
    return str(path)


def _expected(model_dir, user: str, tokens: list[int]) -> list[int]:
    """The ids of a one-turn chat prompt spelled out by hand in the test template's ChatML,
    `<image>` in `user` replaced by the image's vision tokens."""
    from transformers import AutoTokenizer

    for n in tokens:
        user = user.replace("<image>", "<|vision_start|>" + "<|image_pad|>" * n
                            + "<|vision_end|>", 1)
    text = f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    return AutoTokenizer.from_pretrained(model_dir).encode(text, add_special_tokens=False)


def test_image_rows_render_as_the_processor_and_template_make_them(model_dir, images, tmp_path):
    from megarlhf.data.images import read_image_examples

    a, b = images["a"], images["b"]
    pixels_a, grid_a = _processor(model_dir, [a])
    pixels_ab, grid_ab = _processor(model_dir, [b, a])
    assert grid_a.tolist() == [[1, 4, 6]]  # 56x84 px, untouched: 6 tokens
    tokens_b = int(grid_ab[0].prod()) // 4
    assert grid_ab[0].tolist() != [1, 150 // 14, 200 // 14] and 4 <= tokens_b <= 20  # resized
    # An absolute path, and a relative one: read beside the data file.
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b.png").write_bytes(open(b, "rb").read())
    jsonl = _jsonl(tmp_path / "d" / "p.jsonl", [
        {"prompt": "<image>What digits?", "images": [a]},
        {"prompt": [{"role": "user", "content": [
            {"type": "image"}, {"type": "text", "text": "Which is larger?"},
            {"type": "image"}]}], "images": ["b.png", a]},
        {"prompt": "no image here"}])
    with open(a, "rb") as f:
        a_bytes = f.read()
    raw = _parquet(tmp_path / "raw.parquet", [{"prompt": "<image>What digits?",
                                               "images": [a_bytes]}])
    geo3k = _parquet(tmp_path / "geo3k.parquet", [{
        "prompt": [{"role": "user", "content": "<image>What digits?"}],
        "images": [{"bytes": a_bytes, "path": "a.png"}], "data_source": "geo3k",
        "reward_model": {"ground_truth": "12", "style": "rule"}}])
    vision = _vision(model_dir)

    def read(path, kind="prompt", **fields):
        bad = BadRecords("error")
        return read_image_examples(DatasetSource(path=path, fields=fields), kind, vision, bad)

    text, chat, plain = read(jsonl)
    (from_bytes,) = read(raw)
    (from_dict,) = read(geo3k, ground_truth="reward_model.ground_truth")
    one_image = _expected(model_dir, "<image>What digits?", [6])
    for ex in (text, from_bytes, from_dict):
        assert list(ex.prompt) == one_image
        assert torch.equal(ex.images.pixel_values, pixels_a)
        assert torch.equal(ex.images.grid_thw, grid_a) and ex.images.tokens == (6,)
        assert ex.images.sizes == ((84, 56),)
    assert from_dict.record.ground_truth == "12" and from_dict.record.data_source == "geo3k"
    assert "images" not in from_dict.record.metadata
    assert list(chat.prompt) == _expected(model_dir, "<image>Which is larger?<image>",
                                          [tokens_b, 6])
    assert torch.equal(chat.images.pixel_values, pixels_ab)
    assert torch.equal(chat.images.grid_thw, grid_ab) and chat.images.tokens == (tokens_b, 6)
    assert plain.images is None and list(plain.prompt) == _expected(model_dir, "no image here",
                                                                    [])
    # An SFT row: the image tokens in the prompt, the response as the template ends it.
    sft = _jsonl(tmp_path / "sft.jsonl", [{"prompt": "<image>What digits?", "response": "12",
                                           "images": [a]}])
    (ex,) = read(sft, "sft")
    assert list(ex.prompt) == one_image
    assert list(ex.responses[0]) == vision.fmt.tokenizer.encode("12<|im_end|>\n")


def _refusal(model_dir, rows, *, parquet=False, tmp_path, **kwargs) -> str:
    from megarlhf.data.images import read_image_examples

    path = (_parquet(tmp_path / "bad.parquet", rows) if parquet
            else _jsonl(tmp_path / "bad.jsonl", rows))
    with pytest.raises(BadRecordError) as e:
        read_image_examples(DatasetSource(path=path), "prompt", _vision(model_dir, **kwargs),
                            BadRecords("error"))
    assert "\n" not in str(e.value)
    return str(e.value)


def test_bad_images_are_refused_naming_the_row_and_the_image(model_dir, images, tmp_path):
    a = images["a"]
    ok = {"prompt": "<image>hi", "images": [a]}
    message = _refusal(model_dir, [ok, {"prompt": "<image>hi", "images": [a, "nope.png"]}],
                       tmp_path=tmp_path)
    assert f"bad.jsonl:2: missing image file (images[1] ({tmp_path}/nope.png) does not " \
           f"exist)" in message
    message = _refusal(model_dir, [{"prompt": "<image>hi", "images": [b"not a png"]}],
                       parquet=True, tmp_path=tmp_path)
    assert "bad.parquet:row 0: undecodable image (images[0] (9 bytes): cannot identify" in message
    message = _refusal(model_dir, [ok], tmp_path=tmp_path, max_image_pixels=84 * 56 - 1)
    assert f"bad.jsonl:1: image too large (images[0] ({a}) is 84x56 = 4704 pixels, above " \
           f"max_image_pixels=4703)" in message
    for prompt, held in (("<image><image>hi", 2), ("hi", 0),
                         ([{"role": "user", "content": [{"type": "image"}]},
                           {"role": "assistant", "content": "<image>"}], 2)):
        message = _refusal(model_dir, [{"prompt": prompt, "images": [a]}], tmp_path=tmp_path)
        assert f"bad.jsonl:1: image count mismatch (the prompt has {held} image " \
               f"placeholder(s)" in message and "'images' holds 1 image(s)" in message
    message = _refusal(model_dir, [{"prompt": [{"role": "user", "content": [
        {"type": "video"}]}], "images": [a]}], tmp_path=tmp_path)
    assert "bad.jsonl:1: unsupported content part (video" in message
    # Under on_bad_record=skip the good row stays and the bad one is counted by reason.
    from megarlhf.data.images import read_image_examples

    bad = BadRecords("skip")
    kept = read_image_examples(DatasetSource(path=_jsonl(tmp_path / "mixed.jsonl", [
        ok, {"prompt": "hi", "images": ["nope.png"]}])), "prompt", _vision(model_dir), bad)
    assert len(kept) == 1 and bad.counts == {"missing image file": 1}


def test_a_tokenizer_without_the_vision_tokens_is_refused(model_dir, tmp_path):
    import shutil

    from tests import chat_tokenizer

    plain = chat_tokenizer.save(str(tmp_path / "tok"))
    for name in ("config.json", "preprocessor_config.json"):
        shutil.copy(f"{model_dir}/{name}", f"{plain}/{name}")
    with pytest.raises(ValueError, match=r"has no token 296 \(vision_start_token_id of .*"
                                         r"config.json\) that text encodes to"):
        _vision(plain)


def test_the_data_preview_counts_image_tokens(model_dir, images, tmp_path):
    from megarlhf.data.images import load_image_prompts
    from megarlhf.data.prompts import write_prompt_cache
    from megarlhf.ppo import data_command

    path = _jsonl(tmp_path / "p.jsonl", [
        {"prompt": "<image>What digits?", "images": [images["a"]], "ground_truth": "12"},
        {"prompt": "<image><image>Same?", "images": [images["a"], images["a"]]},
        {"prompt": "no image"}])
    prompts, report = load_image_prompts(DatasetSource(path=path), _vision(model_dir))
    text_only = len(prompts[2].ids)
    summary = data_command._describe("prompts", prompts, report, None, model_dir)
    assert "image tokens (counted above): 3 images on 2 prompts; per prompt min 6, mean 9.0, " \
           "max 12" in summary
    assert f"tokens per prompt: min {text_only}, " in summary
    # The counts are of the ids the model reads: text and image tokens.
    assert len(prompts[1].ids) == len(_expected(model_dir, "<image><image>Same?", [6, 6]))
    shown = data_command._render(prompts[1], model_dir)
    head, body = shown.split("\n", 1)
    assert head == (f"--- {path}:2 ({len(prompts[1].ids)} tokens, 12 of them image tokens: "
                    f"84x56 -> grid 1x4x6 = 6 tokens, 84x56 -> grid 1x4x6 = 6 tokens; each "
                    f"image's pads shown once)")
    assert "<|vision_start|><|image_pad|><|vision_end|><|vision_start|><|image_pad|>" \
           "<|vision_end|>Same?" in body
    with pytest.raises(ValueError, match=f"a prompt cache holds token ids only, and {path}:1 "
                                         f"has images"):
        write_prompt_cache(prompts, str(tmp_path / "cache.jsonl"), tokenizer_path=model_dir,
                           source=path)
