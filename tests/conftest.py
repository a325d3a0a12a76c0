"""Shared fixtures. Multi-process tests are marked `slow`; `make test-fast` deselects them."""

from __future__ import annotations

import dataclasses
import re

import pytest

from megarlhf.compat.warnings import KNOWN
from megarlhf.models.presets import preset
from megarlhf.parallel import launch_local
from tests import workers


def pytest_configure(config):
    # pytest resets the warning filters around collection and every test, dropping the ones
    # megarlhf installs when imported; hand it the same list as its own filters.
    for category, start in KNOWN:
        assert ":" not in start  # the ini form separates fields with colons
        config.addinivalue_line("filterwarnings",
                                f"ignore:{re.escape(start)}:{category.__name__}")


@pytest.fixture(scope="session")
def tiny():
    return preset("tiny")


@pytest.fixture(scope="session")
def hf_dirs(tmp_path_factory):
    """Toy HF checkpoints: a causal LM per architecture, and two reward models."""
    from tests import hf_models

    root = tmp_path_factory.mktemp("hf")
    dirs = {arch: hf_models.save_model(str(root / arch), arch) for arch in hf_models.ARCHS}
    for arch in ("llama", "qwen2"):
        dirs[f"{arch}_rm"] = hf_models.save_model(str(root / f"{arch}_rm"), arch, seq_cls=True,
                                                  seed=1)
    return dirs


@pytest.fixture(scope="session")
def lm_ref(tmp_path_factory, tiny):
    """Reference LM weights (TP1/PP1, seed 0) shared by the multi-process tests."""
    path = str(tmp_path_factory.mktemp("ref") / "lm")
    launch_local(workers.write_reference, 1, path, tiny, 0)
    return path


@pytest.fixture(scope="session")
def value_refs(tmp_path_factory, tiny):
    """Reference value-model weights for tied- and untied-embedding configs."""
    refs = {}
    for tied in (False, True):
        model = dataclasses.replace(tiny, tie_embeddings=tied)
        path = str(tmp_path_factory.mktemp("ref") / f"value_tied{int(tied)}")
        launch_local(workers.write_reference, 1, path, model, 0, True)
        refs[tied] = (model, path)
    return refs


@pytest.fixture(scope="session")
def hf_chat_dir(tmp_path_factory):
    """An HF tokenizer directory with a chat template, built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = "hi there how are you the sea is calm fine".split()
    vocab = {"<pad>": 0, "</s>": 1, "<unk>": 2, "<|user|>": 3, "<|assistant|>": 4,
             **{w: i + 5 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    template = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
                "{% if m['role'] == 'assistant' %}</s>{% endif %}{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", chat_template=template,
                                   additional_special_tokens=["<|user|>", "<|assistant|>"])
    path = tmp_path_factory.mktemp("hf_tok")
    fast.save_pretrained(str(path))
    return str(path)
