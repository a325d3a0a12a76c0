"""One small tokenizer interface over HF tokenizers and raw SentencePiece models, and training
a SentencePiece model on text (the demo and tests make their own instead of downloading one).

`load_tokenizer(path)` takes a SentencePiece `.model` file, an HF tokenizer directory, or a
directory holding only `tokenizer.model` (what a checkpoint trained with a raw SentencePiece
model carries in its `hf/` sidecar).
"""

from __future__ import annotations

import abc
import os
import tempfile
from typing import Iterable, Sequence

SP_MODEL_FILE = "tokenizer.model"
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


class Tokenizer(abc.ABC):
    vocab_size: int
    """Token ids lie in [0, vocab_size); the model's vocabulary must be at least this big."""
    eos_id: int
    pad_id: int
    """Fills padding positions (masked out everywhere; any id would do)."""
    has_chat_template: bool = False

    @abc.abstractmethod
    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        """Token ids of `text`, with no special tokens except a BOS if asked and defined."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        """`ids` as text; `skip_special` drops special tokens (a response's stop token)."""

    def render_chat(self, messages: Sequence[tuple[str, str] | dict], *,
                    add_generation_prompt: bool, tools: list[dict] | None = None,
                    chat_template: str | None = None) -> str:
        """`messages` ((role, content) pairs, or message dicts with tool calls and names)
        through the chat template (`chat_template`'s Jinja text instead of the tokenizer's
        when given), with the JSON schemas of `tools` for templates that take them."""
        raise ValueError(f"{self} has no chat template; use template: plain")

    @abc.abstractmethod
    def files(self) -> dict[str, bytes]:
        """The files that recreate this tokenizer (saved into checkpoints and HF exports)."""


class SentencePieceTokenizer(Tokenizer):
    def __init__(self, model_file: str):
        import sentencepiece

        self.path = model_file
        self.sp = sentencepiece.SentencePieceProcessor(model_file=model_file)
        self.vocab_size = self.sp.vocab_size()
        if self.sp.eos_id() < 0:
            raise ValueError(f"{model_file} defines no EOS token; train it with an eos_id")
        self.eos_id = self.sp.eos_id()
        self.pad_id = self.sp.pad_id() if self.sp.pad_id() >= 0 else self.eos_id
        self.bos_id = self.sp.bos_id()

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        bos = [self.bos_id] if add_bos and self.bos_id >= 0 else []
        return bos + self.sp.encode(text)

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        return self.sp.decode(list(ids))  # SentencePiece never renders control tokens

    def files(self) -> dict[str, bytes]:
        with open(self.path, "rb") as f:
            return {SP_MODEL_FILE: f.read()}

    def __repr__(self) -> str:
        return f"SentencePieceTokenizer({self.path!r})"


class HFTokenizer(Tokenizer):
    def __init__(self, directory: str):
        from transformers import AutoTokenizer

        self.path = directory
        self.tok = AutoTokenizer.from_pretrained(directory)
        if self.tok.eos_token_id is None:
            raise ValueError(f"the tokenizer in {directory} defines no EOS token, which ends "
                             f"every response; set eos_token in its tokenizer_config.json")
        self.vocab_size = len(self.tok)  # added tokens included
        self.eos_id = self.tok.eos_token_id
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else self.eos_id
        self.has_chat_template = bool(getattr(self.tok, "chat_template", None))

    def encode(self, text: str, *, add_bos: bool = False) -> list[int]:
        bos = self.tok.bos_token_id
        return ([bos] if add_bos and bos is not None else []) + \
            self.tok.encode(text, add_special_tokens=False)

    def decode(self, ids: Sequence[int], *, skip_special: bool = False) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special)

    def render_chat(self, messages, *, add_generation_prompt: bool,
                    tools: list[dict] | None = None, chat_template: str | None = None) -> str:
        if not self.has_chat_template and chat_template is None:
            return super().render_chat(messages, add_generation_prompt=add_generation_prompt)
        return self.tok.apply_chat_template(
            [m if isinstance(m, dict) else {"role": m[0], "content": m[1]} for m in messages],
            add_generation_prompt=add_generation_prompt, tokenize=False, tools=tools,
            chat_template=chat_template)

    def files(self) -> dict[str, bytes]:
        # What save_pretrained writes is exactly the tokenizer, whatever else the source
        # directory holds (weights, model config).
        with tempfile.TemporaryDirectory() as tmp:
            self.tok.save_pretrained(tmp)
            out = {}
            for name in sorted(os.listdir(tmp)):
                with open(os.path.join(tmp, name), "rb") as f:
                    out[name] = f.read()
            return out

    def __repr__(self) -> str:
        return f"HFTokenizer({self.path!r})"


def is_tokenizer(path: str) -> bool:
    """Whether `load_tokenizer` can load `path`."""
    if os.path.isfile(path):
        return path.endswith(".model")
    return os.path.isdir(path) and any(
        os.path.isfile(os.path.join(path, name)) for name in HF_TOKENIZER_FILES + (SP_MODEL_FILE,))


def tokenizer_fingerprint(hf_dir: str) -> str | None:
    """A hash of what maps text to ids in `hf_dir` (an HF directory or a checkpoint's `hf/`
    sidecar): tokenizer.json's model and added tokens (not its chat template or padding
    settings, which may differ between models that tokenize alike), or the vocabulary files
    of the other formats. None when the directory holds no tokenizer. A SentencePiece .model
    file hashes as a directory holding it does."""
    import hashlib
    import json

    digest = hashlib.sha256()
    if os.path.isfile(hf_dir):
        with open(hf_dir, "rb") as f:
            digest.update(SP_MODEL_FILE.encode() + b"\0" + f.read())
        return digest.hexdigest()
    fast = os.path.join(hf_dir, "tokenizer.json")
    if os.path.isfile(fast):
        with open(fast, encoding="utf-8") as f:
            data = json.load(f)
        digest.update(json.dumps([data.get("model"), [(t.get("id"), t.get("content"))
                                  for t in data.get("added_tokens") or []]],
                                 sort_keys=True).encode())
        return digest.hexdigest()
    files = [n for n in (SP_MODEL_FILE, "vocab.json", "merges.txt", "vocab.txt")
             if os.path.isfile(os.path.join(hf_dir, n))]
    for name in files:
        with open(os.path.join(hf_dir, name), "rb") as f:
            digest.update(name.encode() + b"\0" + f.read())
    return digest.hexdigest() if files else None


def load_tokenizer(path: str) -> Tokenizer:
    if not os.path.exists(path):
        raise ValueError(f"tokenizer {path} does not exist")
    if not is_tokenizer(path):
        raise ValueError(f"{path} is neither a SentencePiece .model file nor a directory with "
                         f"{' / '.join(HF_TOKENIZER_FILES + (SP_MODEL_FILE,))}")
    if os.path.isfile(path):
        return SentencePieceTokenizer(path)
    if any(os.path.isfile(os.path.join(path, name)) for name in HF_TOKENIZER_FILES):
        return HFTokenizer(path)
    return SentencePieceTokenizer(os.path.join(path, SP_MODEL_FILE))


def train_sentencepiece(lines: Iterable[str], out_file: str, *, vocab_size: int,
                        model_type: str = "bpe", byte_fallback: bool = False) -> str:
    """Train a SentencePiece model on `lines` and write it to `out_file` (a .model path).

    Ids 0-3 are pad, unk, bos, eos. Every character of `lines` gets a token; others become
    unk unless `byte_fallback` (which spends 256 ids on bytes, so needs vocab_size > 260).
    """
    import sentencepiece

    if not out_file.endswith(".model"):
        raise ValueError(f"the SentencePiece output must end in .model, got {out_file}")
    lines = [line for line in lines if line.strip()]
    if not lines:
        raise ValueError("no text to train a tokenizer on")
    prefix = out_file[: -len(".model")]
    os.makedirs(os.path.dirname(os.path.abspath(out_file)), exist_ok=True)
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_prefix=prefix, vocab_size=vocab_size,
        model_type=model_type, pad_id=0, unk_id=1, bos_id=2, eos_id=3, byte_fallback=byte_fallback,
        character_coverage=1.0, num_threads=1, minloglevel=2,
    )
    os.remove(f"{prefix}.vocab")
    return out_file


def eos_token_ids(hf_dir: str) -> tuple[int, ...]:
    """Every id that ends a sample of the model in `hf_dir` (an HF directory, or a checkpoint's
    `hf/` sidecar): generation_config.json's and config.json's `eos_token_id` (an id or a
    list: chat models often stop on end-of-turn as well as end-of-text) and the tokenizer's
    EOS. Sorted, without repeats; () when none is given."""
    import json

    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(hf_dir, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                value = json.load(f).get("eos_token_id")
            ids.update([value] if isinstance(value, int) else value or [])
    if is_tokenizer(hf_dir):
        try:
            ids.add(load_tokenizer(hf_dir).eos_id)
        except ValueError:
            pass  # a tokenizer without an EOS token adds no id
    return tuple(sorted(ids))
