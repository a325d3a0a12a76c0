"""The data pipeline: reading and bad records, tokenizers and prompt formats, truncation,
seeded order, packing and pair batches, and the demo data."""

from __future__ import annotations

import dataclasses
import json
import re
import sys

import pytest

from megarlhf.data import synthetic
from megarlhf.data.config import DataConfig, DatasetSource
from megarlhf.data.dataset import load_examples
from megarlhf.data.encode import Example, encode_records, fit
from megarlhf.data.order import EpochStream, shuffled, split_eval
from megarlhf.data.packing import document_mask, one_per_row, pack, sft_batch
from megarlhf.data.pairs import pair_batch
from megarlhf.data.prompts import load_prompts, write_prompt_cache
from megarlhf.data.records import read_records
from megarlhf.data.report import BadRecordError, BadRecords
from megarlhf.data.templates import PromptFormat
from megarlhf.data.tokenizer import (SentencePieceTokenizer, load_tokenizer,
                                     train_sentencepiece)


@pytest.fixture(scope="module")
def sp_path(tmp_path_factory):
    return train_sentencepiece(synthetic.tokenizer_corpus(),
                               str(tmp_path_factory.mktemp("tok") / "sp.model"), vocab_size=256)


@pytest.fixture(scope="module")
def sp(sp_path):
    return load_tokenizer(sp_path)


def _jsonl(path, lines) -> str:
    with open(path, "wb") as f:
        for line in lines:
            f.write(line if isinstance(line, bytes) else json.dumps(line).encode() + b"\n")
    return str(path)


# -- records and bad records --

def test_jsonl_records_with_mapped_fields_and_message_prompts(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [
        {"q": "Tell me about the sea.", "good": "Calm.", "bad": "Grey.", "m": 2},
        b"\n",  # blank lines are not records
        {"q": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
         "good": "Hello.", "bad": "Go away."}])
    src = DatasetSource(path=path, fields={"prompt": "q", "chosen": "good", "rejected": "bad",
                                           "margin": "m"})
    bad = BadRecords("error")
    first, second = read_records(src, "pairwise", bad)
    assert (first.prompt, first.responses, first.margin) == (
        "Tell me about the sea.", ("Calm.", "Grey."), 2.0)
    assert second.prompt == (("system", "Be brief."), ("user", "Hi")) and second.margin is None
    assert first.where == f"{path}:1" and second.where == f"{path}:3"


BAD_LINES = [
    ({"response": "x"}, "missing field 'prompt'"),
    ({"prompt": "  ", "response": "x"}, "empty prompt"),
    ({"prompt": "p", "response": ""}, "empty response"),
    (b'{"prompt": "caf\xe9", "response": "x"}\n', "invalid UTF-8"),
    (b'{"prompt": "p", "response": \n', "invalid JSON"),
    ([1, 2], "not a JSON object"),
    ({"prompt": 3, "response": "x"}, "field 'prompt' is not text"),
    ({"prompt": [{"role": "bot", "content": "x"}], "response": "x"}, "malformed messages"),
    ({"prompt": "<image> What is drawn?", "response": "x", "images": ["a.png"]},
     "images for a text-only model"),
]


@pytest.mark.parametrize("line,reason", BAD_LINES, ids=[r for _, r in BAD_LINES])
def test_bad_record_is_an_error_naming_file_and_line(tmp_path, line, reason):
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "response": "r"}, line])
    with pytest.raises(BadRecordError, match=f"{path}:2: {reason}.*on_bad_record=skip"):
        read_records(DatasetSource(path=path), "sft", BadRecords("error"))


def test_bad_records_are_skipped_counted_and_reported(tmp_path):
    path = _jsonl(tmp_path / "d.jsonl", [{"prompt": "p", "response": "r"}]
                  + [line for line, _ in BAD_LINES] + [{"prompt": "q", "response": "s"}])
    bad = BadRecords("skip")
    records = read_records(DatasetSource(path=path), "sft", bad)
    assert [r.prompt for r in records] == ["p", "q"]
    assert bad.skipped == len(BAD_LINES)
    assert bad.summary()["reasons"] == {reason: 1 for _, reason in BAD_LINES}
    assert bad.summary()["examples"][0] == f"{path}:2: missing field 'prompt' (the prompt of a " \
                                           f"sft record)"


def _conv(*turns):
    return [{"role": role, "content": text} for role, text in turns]


PAIR_LINES = [  # (row, prompt, responses) or (row, reason)
    # UltraFeedback's layout: a prompt, and each response as the whole conversation.
    ({"prompt": "Hi", "chosen": _conv(("user", "Hi"), ("assistant", "Hello.")),
      "rejected": _conv(("user", "Hi"), ("assistant", "Go."))}, "Hi", ("Hello.", "Go.")),
    # No prompt column: the conversation before the responses is the prompt.
    ({"chosen": _conv(("system", "Be kind."), ("user", "Hi"), ("assistant", "Hello.")),
      "rejected": _conv(("system", "Be kind."), ("user", "Hi"), ("assistant", "Go."))},
     (("system", "Be kind."), ("user", "Hi")), ("Hello.", "Go.")),
    # Only the responses as messages, next to a message prompt.
    ({"prompt": _conv(("user", "Hi")), "chosen": _conv(("assistant", "Hello.")),
      "rejected": "Go."}, (("user", "Hi"),), ("Hello.", "Go.")),
    ({"chosen": _conv(("user", "Hi"), ("assistant", "A")),
      "rejected": _conv(("user", "Hey"), ("assistant", "B"))},
     "prompt differs between 'chosen' and 'rejected'"),
    ({"prompt": "Hi", "chosen": _conv(("user", "Hey"), ("assistant", "A")), "rejected": "B"},
     "prompt differs between 'prompt' and 'chosen'"),
    ({"prompt": "Hi", "chosen": _conv(("assistant", "A"), ("user", "B")), "rejected": "B"},
     "field 'chosen' does not end with an assistant message"),
    ({"chosen": "A", "rejected": "B"}, "missing field 'prompt'"),
]


@pytest.mark.parametrize("case", PAIR_LINES, ids=range(len(PAIR_LINES)))
def test_conversational_pairs_give_their_prompt_once_and_must_agree_on_it(tmp_path, case):
    path = _jsonl(tmp_path / "p.jsonl", [case[0]])
    bad = BadRecords("skip")
    records = read_records(DatasetSource(path=path), "pairwise", bad)
    if len(case) == 3:
        assert [(r.prompt, r.responses) for r in records] == [case[1:]]
    else:
        assert records == [] and list(bad.summary()["reasons"]) == [case[1]]


def test_unpaired_records_take_true_false_or_1_0_labels(tmp_path):
    path = _jsonl(tmp_path / "u.jsonl", [
        {"prompt": "p", "completion": "a", "label": True},
        {"prompt": "p", "completion": "b", "label": 0},
        {"prompt": "p", "completion": "c", "label": "yes"},
        {"prompt": "p", "completion": "d"}])
    bad = BadRecords("skip")
    records = read_records(DatasetSource(path=path), "unpaired", bad)
    assert [(r.responses, r.label) for r in records] == [(("a",), True), (("b",), False)]
    assert bad.summary()["reasons"] == {"field 'label' is not true/false": 1,
                                        "missing field 'label'": 1}


def test_parquet_records(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = str(tmp_path / "d.parquet")
    pq.write_table(pa.table({"prompt": ["a", "b", None], "response": ["x", "y", "z"]}), path)
    bad = BadRecords("skip")
    records = read_records(DatasetSource(path=path), "sft", bad)
    assert [r.responses for r in records] == [("x",), ("y",)]
    assert bad.summary()["examples"] == [f"{path}:row 2: missing field 'prompt' (the prompt "
                                         f"of a sft record)"]


def test_hf_datasets_directory(tmp_path):
    datasets = pytest.importorskip("datasets")
    path = str(tmp_path / "ds")
    datasets.DatasetDict({
        "train": datasets.Dataset.from_dict({"prompt": ["a"], "response": ["x"]}),
        "test": datasets.Dataset.from_dict({"prompt": ["b"], "response": ["y"]}),
    }).save_to_disk(path)
    records = read_records(DatasetSource(path=path, split="test"), "sft", BadRecords("error"))
    assert records[0].prompt == "b" and records[0].where == f"{path}[test]:row 0"
    with pytest.raises(ValueError, match=r"has splits \['test', 'train'\]"):
        read_records(DatasetSource(path=path, split="dev"), "sft", BadRecords("error"))


@pytest.mark.parametrize("module,path,match", [
    ("pyarrow", "d.parquet", "needs pyarrow, which is not installed"),
    ("datasets", "ds_dir", "needs `datasets`, which is not installed"),
])
def test_missing_optional_readers_give_a_clear_error(tmp_path, monkeypatch, module, path,
                                                     match):
    monkeypatch.setitem(sys.modules, module, None)  # makes `import module` fail
    target = tmp_path / path
    target.mkdir() if path.endswith("dir") else target.write_bytes(b"")
    with pytest.raises(ValueError, match=match):
        read_records(DatasetSource(path=str(target)), "sft", BadRecords("error"))


def test_reader_errors_for_paths_and_field_maps(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        read_records(DatasetSource(path=str(tmp_path / "no.jsonl")), "sft", BadRecords("error"))
    with pytest.raises(ValueError, match=r"fields \['chosen'\] are not fields of sft"):
        read_records(DatasetSource(path="x", fields={"chosen": "c"}), "sft", BadRecords("skip"))
    with pytest.raises(ValueError, match="unknown dataset format"):
        DatasetSource(path="x", format="csv")


# -- tokenizers and prompt formats --

def test_sentencepiece_training_and_loading(sp_path, sp, tmp_path):
    assert isinstance(sp, SentencePieceTokenizer) and sp.vocab_size == 256
    assert (sp.pad_id, sp.eos_id, sp.bos_id) == (0, 3, 2)
    text = "Tell me about the sea."
    assert sp.decode(sp.encode(text)) == text
    assert len(sp.encode("the sea is wonderful")) <= 6  # words of the corpus are few tokens
    again = train_sentencepiece(synthetic.tokenizer_corpus(), str(tmp_path / "again.model"),
                                vocab_size=256)
    assert load_tokenizer(again).encode(text) == sp.encode(text)  # deterministic
    (tmp_path / "ckpt_hf").mkdir()  # a checkpoint sidecar with only the raw model file
    (tmp_path / "ckpt_hf" / "tokenizer.model").write_bytes(sp.files()["tokenizer.model"])
    assert load_tokenizer(str(tmp_path / "ckpt_hf")).encode(text) == sp.encode(text)
    with pytest.raises(ValueError, match="neither a SentencePiece .model file nor"):
        load_tokenizer(str(tmp_path))


def test_plain_format(sp):
    fmt = PromptFormat(sp, "auto")
    assert fmt.name == "plain"
    prompt = fmt.prompt("Describe the sea.")
    assert prompt[0] == sp.bos_id
    assert sp.decode(prompt[1:]) == "Human: Describe the sea. Assistant:"
    response = fmt.response("Describe the sea.", "The sea is calm.")
    assert response[-1] == sp.eos_id and sp.decode(response[:-1]) == "The sea is calm."
    turns = fmt.prompt((("user", "Hi"), ("assistant", "Hello."), ("user", "Describe winter.")))
    assert sp.decode(turns[1:]) == "Human: Hi Assistant: Hello. Human: Describe winter. " \
                                   "Assistant:"
    with pytest.raises(ValueError, match="has no chat template"):
        PromptFormat(sp, "chat")


def test_chat_template_format(hf_chat_dir):
    tok = load_tokenizer(hf_chat_dir)
    fmt = PromptFormat(tok, "auto")
    assert fmt.name == "chat" and tok.vocab_size == 15
    prompt = fmt.prompt("hi there")
    response = fmt.response("hi there", "the sea is calm")
    assert tok.decode(prompt) == tok.tok.apply_chat_template(
        [{"role": "user", "content": "hi there"}], add_generation_prompt=True, tokenize=False)
    assert response[-1] == tok.eos_id  # the template's end of turn, not one added by us
    assert tok.decode(response).split() == ["the", "sea", "is", "calm", "</s>"]
    assert set(tok.files()) >= {"tokenizer.json", "tokenizer_config.json"}
    assert PromptFormat(tok, "plain").name == "plain"


# -- truncation --

@pytest.mark.parametrize("prompt,responses,floor,expected", [
    (5, [3], 1, (5, [3])),              # fits
    (8, [4], 2, (6, [4])),              # prompt loses 2 from the left
    (8, [9], 2, (2, [8])),              # prompt down to the floor, then the response
    (8, [4, 9], 2, (2, [4, 8])),        # one prompt for both responses of a pair
    (12, [4], None, (12, [0])),         # prompt never cut: no room left
    (15, [], 1, (10, [])),              # a prompt alone keeps its last tokens
])
def test_fit_cuts_prompt_from_the_left_first(prompt, responses, floor, expected):
    p, rs = fit(list(range(prompt)), [list(range(100, 100 + n)) for n in responses],
                max_length=10, min_prompt_tokens=floor)
    assert (len(p), [len(r) for r in rs]) == expected
    assert p == list(range(prompt))[prompt - len(p):]  # the end of the prompt is kept
    assert all(r == list(range(100, 100 + len(r))) for r in rs)  # the start of responses


def _records(tmp_path, lines, kind="sft"):
    return read_records(DatasetSource(path=_jsonl(tmp_path / "d.jsonl", lines)), kind,
                        BadRecords("error"))


def test_response_cut_to_nothing_is_an_error_or_a_counted_skip(tmp_path, sp):
    long = " ".join(["the sea is wonderful"] * 10)
    records = _records(tmp_path, [{"prompt": long, "response": "Calm."},
                                  {"prompt": "Hi.", "response": "Calm."}])
    fmt = PromptFormat(sp, "plain")
    with pytest.raises(BadRecordError, match=r":1: response truncated to zero tokens \(prompt "
                                             r"of \d+ tokens leaves none of max_length=16\)"):
        encode_records(records, fmt, max_length=16, min_prompt_tokens=None,
                       bad=BadRecords("error"))
    bad = BadRecords("skip")
    kept = encode_records(records, fmt, max_length=16, min_prompt_tokens=None, bad=bad)
    assert len(kept) == 1 and bad.counts == {"response truncated to zero tokens": 1}
    # With the default floor the same record keeps its response and loses prompt tokens.
    bad = BadRecords("error")
    kept = encode_records(records, fmt, max_length=16, min_prompt_tokens=1, bad=bad)
    assert [ex.length() for ex in kept][0] == 16 and bad.truncated["prompt"] == 1
    assert kept[0].responses[0] == tuple(fmt.response("", "Calm."))


def test_pairs_equal_after_truncation_are_bad(tmp_path, sp):
    records = _records(tmp_path, [
        {"prompt": "Hi.", "chosen": "The sea is wonderful.", "rejected": "The sea is dull."},
        {"prompt": "Hi.", "chosen": "Same.", "rejected": "Same."}], kind="pairwise")
    bad = BadRecords("skip")
    fmt = PromptFormat(sp, "plain")
    kept = encode_records(records, fmt, max_length=len(fmt.prompt("Hi.")) + 2,
                          min_prompt_tokens=None, bad=bad)
    assert kept == [] and bad.counts == {"chosen equals rejected after truncation": 1,
                                         "chosen equals rejected": 1}


# -- order, split --

def test_shuffle_split_and_epochs_are_seeded():
    items = list(range(10))
    assert shuffled(items, 1) == shuffled(items, 1) != shuffled(items, 2)
    train, held = split_eval(items, 0.25, seed=3)
    assert len(held) == 2 and sorted(train + held) == items
    assert split_eval(items, 0.25, seed=3) == (train, held)
    with pytest.raises(ValueError, match="leaves none for training"):
        split_eval([1], 0.5, seed=0)
    stream = EpochStream(items, seed=5)
    rows, epoch = stream.take(8, 5)  # crosses into epoch 1
    assert rows == stream.epoch(0)[8:] + stream.epoch(1)[:3] and epoch == pytest.approx(1.3)
    assert sorted(stream.epoch(1)) == items and stream.epoch(1) != stream.epoch(0)
    # A fresh stream (a resumed run) continues exactly where the first one was.
    assert EpochStream(items, seed=5).take(13, 4)[0] == stream.take(13, 4)[0]


# -- packing and pair batches --

def _ex(prompt, response):
    return Example(prompt=tuple(prompt), responses=(tuple(response),))


def test_packed_rows_keep_documents_apart():
    docs = [_ex([11, 12], [13, 14, 15]), _ex([21], [22]), _ex([31, 32, 33], [34])]
    rows = pack(docs, row_length=8)
    assert rows == [[docs[0], docs[1]], [docs[2]]]  # best fit: doc 3 does not fit row 0
    batch = sft_batch(rows, pad_id=0)
    assert batch["tokens"].tolist() == [[11, 12, 13, 14, 15, 21, 22], [31, 32, 33, 34, 0, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1], [0, 1, 2, 3, 0, 0, 0]]
    # Labels never cross a document boundary; loss only where the label is a response token.
    assert batch["labels"][0].tolist() == [12, 13, 14, 15, 0, 22, 0]
    assert batch["loss_mask"].tolist() == [[0, 1, 1, 1, 0, 1, 0], [0, 0, 1, 0, 0, 0, 0]]
    allowed = ~document_mask(batch["document_ids"])[:, 0]
    assert allowed[0, 6].tolist() == [False] * 5 + [True, True]  # doc 2 sees only itself
    assert allowed[0, 4].tolist() == [True] * 5 + [False, False]
    assert allowed[1, 5].tolist() == [False] * 5 + [True, False]  # padding sees itself
    unpacked = sft_batch(one_per_row(docs), pad_id=0)
    assert unpacked["loss_mask"].sum() == batch["loss_mask"].sum()
    with pytest.raises(ValueError, match="does not fit rows of 4"):
        pack(docs, row_length=4)


def test_packing_fills_rows_and_loses_nothing(sp):
    examples = [_ex([1] * (1 + i % 7), [2] * (1 + i % 5)) for i in range(200)]
    rows = pack(shuffled(examples, 0), row_length=32)
    assert sorted(map(id, (ex for row in rows for ex in row))) == sorted(map(id, examples))
    assert all(sum(ex.length() for ex in row) <= 32 for row in rows)
    used = sum(ex.length() for ex in examples) / (32 * len(rows))
    assert used > 0.95


def test_pair_batch_puts_chosen_and_rejected_side_by_side():
    pairs = [Example(prompt=(5, 6), responses=((7, 8, 9), (10,)), margin=0.5),
             Example(prompt=(5,), responses=((11,), (12, 13)))]
    batch = pair_batch(pairs, pad_id=0)
    assert batch["tokens"].tolist() == [[5, 6, 7, 8, 9], [5, 6, 10, 0, 0], [5, 11, 0, 0, 0],
                                        [5, 12, 13, 0, 0]]
    assert batch["last_index"].tolist() == [4, 2, 1, 2]
    assert batch["margin"].tolist() == [0.5, 0.5, 0.0, 0.0]
    assert batch["pair_weight"].tolist() == [1.0] * 4
    assert batch["position_ids"][1].tolist() == [0, 1, 2, 2, 2]


# -- end to end, demo data --

def test_load_examples_holds_out_eval_and_reports(tmp_path, sp_path):
    path = synthetic.write_jsonl(synthetic.sft_records(50) + [{"prompt": "x"}],
                                 str(tmp_path / "s.jsonl"))
    cfg = DataConfig(train=DatasetSource(path=path), tokenizer=sp_path, eval_fraction=0.2,
                     max_length=32, on_bad_record="skip")
    ex = load_examples(cfg, "sft", load_tokenizer(sp_path))
    assert (len(ex.train), len(ex.eval)) == (40, 10)
    assert ex.report["train"]["reasons"] == {"missing field 'response'": 1}
    assert ex.report["template"] == "plain"
    assert load_examples(cfg, "sft", load_tokenizer(sp_path)).eval == ex.eval


def test_demo_data_is_deterministic_and_learnable(tmp_path, sp):
    assert synthetic.preference_records(20) == synthetic.preference_records(20)
    pairs = synthetic.preference_records(200)
    assert all(synthetic.is_warm(p["chosen"]) and not synthetic.is_warm(p["rejected"])
               for p in pairs)
    warm = sum(synthetic.is_warm(r["response"]) for r in synthetic.sft_records(400)) / 400
    assert 0.4 < warm < 0.6
    path = synthetic.write_jsonl(synthetic.prompt_records(5), str(tmp_path / "p.jsonl"))
    prompts, report = load_prompts(DatasetSource(path=path), lambda: sp)
    ids = [list(p.ids) for p in prompts]
    assert report["kept"] == 5 and ids[0] == PromptFormat(sp, "auto").prompt(
        synthetic.prompt_records(5)[0]["prompt"])
    assert all(sp.sp.unk_id() not in i for i in ids)  # the corpus covers the demo data


# -- prompt datasets for RL (text, chat, pre-tokenized; ground truth and metadata) --

VERL_ROW = {"data_source": "openai/gsm8k", "ability": "math",
            "prompt": [{"role": "user", "content": "how are you"}],
            "reward_model": {"style": "rule", "ground_truth": "72"},
            "extra_info": {"index": 4, "split": "train"}}


def _prompt_source(path, **fields):
    return DatasetSource(path=str(path), fields=fields)


def test_prompt_rows_in_every_form_carry_truth_source_and_metadata(tmp_path, hf_chat_dir):
    tok = load_tokenizer(hf_chat_dir)
    path = _jsonl(tmp_path / "p.jsonl", [
        {"prompt": "hi there", "ground_truth": "fine", "data_source": "chat", "level": 2},
        {"messages": [{"role": "user", "content": "how are you"}], "ground_truth": 3},
        {"prompt_ids": [3, 5, 4], "ground_truth": ["a", "b"]},
    ])
    prompts, report = load_prompts(_prompt_source(path), lambda: tok, template="chat")
    chat = PromptFormat(tok, "chat")
    assert [list(p.ids) for p in prompts] == [chat.prompt("hi there"),
                                              chat.prompt((("user", "how are you"),)),
                                              [3, 5, 4]]
    assert [p.ground_truth for p in prompts] == ["fine", 3, ["a", "b"]]
    assert prompts[0].data_source == "chat" and prompts[0].metadata == {"level": 2}
    assert prompts[1].metadata == {} and report["template"] == "chat" and report["kept"] == 3


@pytest.mark.parametrize("form", ["parquet", "hf"])
def test_verl_rows_read_as_they_are_with_a_dotted_field_mapping(tmp_path, hf_chat_dir, form):
    rows = [VERL_ROW, {**VERL_ROW, "reward_model": {"style": "rule", "ground_truth": "8"}}]
    if form == "parquet":
        pa = pytest.importorskip("pyarrow")
        import pyarrow.parquet as pq

        path = tmp_path / "train.parquet"
        pq.write_table(pa.Table.from_pylist(rows), str(path))
    else:
        datasets = pytest.importorskip("datasets")
        path = tmp_path / "hf"
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    tok = load_tokenizer(hf_chat_dir)
    prompts, _ = load_prompts(_prompt_source(path, ground_truth="reward_model.ground_truth"),
                              lambda: tok)
    assert [p.ground_truth for p in prompts] == ["72", "8"]
    assert prompts[0].data_source == "openai/gsm8k"
    assert list(prompts[0].ids) == PromptFormat(tok, "chat").prompt((("user", "how are you"),))
    assert prompts[0].metadata["extra_info"] == {"index": 4, "split": "train"}
    assert prompts[0].metadata["ability"] == "math"  # every other column reaches the reward


@pytest.mark.parametrize("row,reason", [
    ({"prompt_ids": [1, "x"]}, "field 'prompt_ids' is not a non-empty list of token ids"),
    ({"prompt_ids": []}, "field 'prompt_ids' is not a non-empty list of token ids"),
    ({"prompt": "hi", "data_source": 3}, "field 'data_source' is not text"),
    ({"question": "hi"}, "missing field 'prompt'"),
])
def test_bad_prompt_rows_are_named(tmp_path, row, reason):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt_ids": [1]}, row])
    with pytest.raises(BadRecordError, match=rf"p.jsonl:2: {re.escape(reason)}.*set "
                                             rf"on_bad_record=skip"):
        load_prompts(_prompt_source(path), None)
    prompts, report = load_prompts(_prompt_source(path), None, on_bad_record="skip")
    assert len(prompts) == 1 and report["reasons"] == {reason: 1}


def test_text_prompts_without_a_tokenizer_are_refused(tmp_path):
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "hi"}])
    with pytest.raises(ValueError, match="p.jsonl:1: the prompt is text, but no tokenizer"):
        load_prompts(_prompt_source(path), None)


def test_a_prompt_cache_reads_back_equal_and_refuses_edits_and_other_tokenizers(
        tmp_path, hf_chat_dir, sp_path):
    tok = load_tokenizer(hf_chat_dir)
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "hi there", "ground_truth": "x",
                                          "data_source": "s", "level": 1},
                                         {"prompt": "the sea", "ground_truth": None}])
    prompts, _ = load_prompts(_prompt_source(path), lambda: tok)
    cache = str(tmp_path / "cache.jsonl")
    write_prompt_cache(prompts, cache, tokenizer_path=hf_chat_dir, source=path)
    again, report = load_prompts(_prompt_source(cache), None, tokenizer_path=hf_chat_dir)
    assert [dataclasses.replace(p, where="") for p in again] == \
        [dataclasses.replace(p, where="") for p in prompts]
    assert report["template"] == "pre-tokenized"
    with pytest.raises(ValueError, match="another tokenizer than this run's"):
        load_prompts(_prompt_source(cache), None, tokenizer_path=sp_path)
    write_prompt_cache(prompts[:1], cache, tokenizer_path=hf_chat_dir, source=path)  # ours
    with open(cache, "a") as f:
        f.write('{"prompt_ids": [1]}\n')
    with pytest.raises(ValueError, match="does not match the checksum it was written with"):
        load_prompts(_prompt_source(cache), None)
    with pytest.raises(ValueError, match="exists and is not a prompt cache megarlhf wrote"):
        write_prompt_cache(prompts, path, tokenizer_path=None, source=path)
    assert json.loads(open(path).readline())["prompt"] == "hi there"  # untouched


def test_the_data_command_previews_a_recipes_prompts_and_writes_a_cache(tmp_path, hf_chat_dir,
                                                                       capsys):
    from megarlhf.cli import main as cli
    from megarlhf.ppo.config import PPOConfig
    from megarlhf.ppo.data import read_run_prompts

    (tmp_path / "actor").mkdir()  # not a checkpoint yet: overlong rows cannot be counted
    prompts = _jsonl(tmp_path / "p.jsonl", [{"q": "hi there", "a": "fine", "data_source": "s"},
                                            {"q": "the sea", "a": "calm"}, {"a": "x"}])
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"actor: {tmp_path}/actor\nprompts: {prompts}\nout_dir: {tmp_path}/out\n"
                      f"reward_fn: exact_match\nalgorithm: grpo\nsamples_per_prompt: 2\n"
                      f"tokenizer: {hf_chat_dir}\non_bad_record: skip\n"
                      f"prompt_fields: {{prompt: q, ground_truth: a}}\n")
    cache = tmp_path / "cache.jsonl"
    with pytest.raises(SystemExit) as done:
        cli(["data", "--config", str(recipe), "--write-cache", str(cache)])
    out = capsys.readouterr().out
    assert done.value.code == 0, out
    assert "2 prompts kept, 1 skipped {\"missing field 'q'\": 1}; format chat" in out
    assert "overlong: unknown" in out and "ground truth on 2 of 2; data sources: s" in out
    assert "<|user|> hi there <|assistant|>" in out and "ground_truth: 'fine'" in out
    config = PPOConfig(actor=str(tmp_path / "actor"), prompts=str(cache), out_dir=str(tmp_path),
                       reward_fn="exact_match", algorithm="grpo", samples_per_prompt=2,
                       tokenizer=hf_chat_dir)
    cached, report = read_run_prompts(config)
    original, _ = read_run_prompts(PPOConfig(**{**config.__dict__, "prompts": prompts,
                                                "on_bad_record": "skip",
                                                "prompt_fields": {"prompt": "q",
                                                                  "ground_truth": "a"}}))
    assert report["template"] == "pre-tokenized"
    assert [(p.ids, p.ground_truth, p.data_source) for p in cached] == \
        [(p.ids, p.ground_truth, p.data_source) for p in original]
