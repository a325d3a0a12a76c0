"""HF <-> Megatron converters in one process: mapping rules, config translation, exact round
trips, dtype, sharded export that transformers loads, and bad input."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import io
import json
import logging
import os
import zipfile
import shutil

import pytest
import torch
import transformers

from megarlhf.convert.hf_to_mcore import hf_to_mcore
from megarlhf.convert.mcore_to_hf import mcore_to_hf
from megarlhf.convert.safetensors_io import SafetensorsReader
from megarlhf.convert.verify import HF_FP32_FACTOR, HFOutputs, VerifyReport, compare
from megarlhf.engine.checkpoint import read_meta
from megarlhf.models.arch import architecture, architecture_for_hf_class, architecture_for_model
from megarlhf.models.config import ModelConfig
from megarlhf.parallel.mesh import ParallelConfig
from tests import hf_models

TP2PP2 = ParallelConfig(tensor_parallel=2, pipeline_parallel=2)


def assert_same_tensors(dir_a: str, dir_b: str) -> None:
    a, b = SafetensorsReader(dir_a), SafetensorsReader(dir_b)
    assert sorted(a.names()) == sorted(b.names())
    for name in a.names():
        x, y = a.get(name), b.get(name)
        assert x.dtype == y.dtype and torch.equal(x, y), name


def load_json(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


@pytest.mark.parametrize("arch", list(hf_models.ARCHS))
def test_rules_fuse_and_split_are_exact_inverses(arch):
    config = hf_models.make_config(arch)
    a, _ = architecture_for_hf_class(config.architectures[0])
    model = a.model_config(config)
    for rule in a.rules(model, lm_head=True, value_head=True):
        parts = [torch.randn(shape) for shape in rule.hf_shapes]
        back = rule.split(rule.fuse(parts))
        assert all(torch.equal(x, y) for x, y in zip(parts, back)), rule.mcore


def test_fused_qkv_is_grouped_by_kv_head():
    # Megatron's row order: for each KV group, its query heads, then its key, then its value.
    model = ModelConfig(vocab_size=8, hidden_size=8, ffn_hidden_size=8, num_layers=1,
                        num_attention_heads=4, num_kv_heads=2, head_dim=2)
    rule = next(r for r in architecture("llama").rules(model, lm_head=True, value_head=False)
                if r.mcore.endswith("linear_qkv.weight"))

    def heads(*ids):  # head_dim=2 rows per head, each row holding its head id
        return torch.tensor(ids, dtype=torch.float).repeat_interleave(2)[:, None].expand(-1, 8)

    fused = rule.fuse([heads(0, 1, 2, 3), heads(10, 11), heads(20, 21)])
    assert fused[::2, 0].tolist() == [0, 1, 10, 20, 2, 3, 11, 21]


@pytest.mark.parametrize("arch,expect", [
    ("llama", dict(rope_scaling_type="llama3", qkv_bias=False, qk_norm=False, tied=False,
                   kv_channels=16, theta=500000.0)),
    ("mistral", dict(rope_scaling_type="linear", qkv_bias=False, qk_norm=False, tied=False,
                     kv_channels=16, theta=1e6)),
    ("qwen2", dict(rope_scaling_type=None, qkv_bias=True, qk_norm=False, tied=True,
                   kv_channels=16, theta=10000.0)),
    ("qwen3", dict(rope_scaling_type=None, qkv_bias=False, qk_norm=True, tied=False,
                   kv_channels=32, theta=10000.0)),
    ("qwen3_moe", dict(rope_scaling_type=None, qkv_bias=False, qk_norm=True, tied=False,
                       kv_channels=32, theta=10000.0)),
    ("mixtral", dict(rope_scaling_type=None, qkv_bias=False, qk_norm=False, tied=False,
                     kv_channels=16, theta=1e6)),
])
def test_config_translation(arch, expect):
    config = hf_models.make_config(arch)
    a, is_seq_cls = architecture_for_hf_class(config.architectures[0])
    assert a.name == arch and not is_seq_cls
    m = a.model_config(config)
    assert (m.rope_scaling.rope_type if m.rope_scaling else None) == expect["rope_scaling_type"]
    assert (m.qkv_bias, m.qk_norm, m.tie_embeddings) == (expect["qkv_bias"], expect["qk_norm"],
                                                         expect["tied"])
    assert (m.kv_channels, m.rope_theta, m.kv_heads, m.norm_eps) == (
        expect["kv_channels"], expect["theta"], 2, 1e-6)
    if arch == "llama":
        s = m.rope_scaling
        assert (s.factor, s.low_freq_factor, s.high_freq_factor,
                s.original_max_position_embeddings) == (8.0, 1.0, 4.0, 64)
    moe = {"qwen3_moe": (4, 48, 2, False), "mixtral": (4, 48, 2, True)}.get(arch)
    assert (m.num_experts, m.moe_ffn_hidden_size, m.moe_router_topk, m.moe_norm_topk) == (
        moe or (None, None, 2, True))
    assert m.moe_aux_loss_coeff == 0.0  # HF trains without it unless output_router_logits


def test_moe_aux_loss_coefficient_follows_hf_training():
    config = hf_models.make_config("mixtral", output_router_logits=True,
                                   router_aux_loss_coef=0.02)
    assert architecture("mixtral").model_config(config).moe_aux_loss_coeff == 0.02


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_moe_hf_config_of_a_model_without_hf_origin_round_trips(arch):
    a = architecture(arch)
    m = a.model_config(hf_models.make_config(arch, output_router_logits=True,
                                             router_aux_loss_coef=0.01))
    config = getattr(transformers, hf_models.ARCHS[arch][0] + "Config")(**a.hf_config(m))
    back = a.model_config(config)
    assert back.kv_channels == m.kv_channels  # head_dim written out even where HF derives it
    assert dataclasses.replace(back, head_dim=m.head_dim) == m
    assert architecture_for_model(m).name == arch  # the MoE look-alike, not the dense base


def test_sliding_window_shorter_than_context_caps_the_context(caplog):
    config = hf_models.make_config("mistral", sliding_window=128)
    with caplog.at_level(logging.WARNING):
        m = architecture("mistral").model_config(config)
    assert m.max_position_embeddings == 128
    assert "sliding-window" in caplog.text


@pytest.mark.parametrize("arch,overrides,match", [
    ("llama", dict(attention_bias=True), "attention_bias"),
    ("llama", dict(hidden_act="gelu"), "hidden_act"),
    ("llama", dict(rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                 "original_max_position_embeddings": 64}), "RoPE type 'yarn'"),
    ("qwen3_moe", dict(mlp_only_layers=[1]), "mlp_only_layers"),
    ("qwen3_moe", dict(decoder_sparse_step=2), "decoder_sparse_step"),
    ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise"),
])
def test_unsupported_features_are_refused(arch, overrides, match):
    with pytest.raises(ValueError, match=match):
        architecture(arch).model_config(hf_models.make_config(arch, **overrides))


def test_unsupported_architecture_lists_the_supported_ones():
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*supported: LlamaForCausalLM"):
        architecture_for_hf_class("GPT2LMHeadModel")


@pytest.mark.parametrize("name", ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral",
                                  "llama_rm", "qwen2_rm"])
def test_round_trip_is_bitwise_with_equal_config(hf_dirs, tmp_path, name):
    role = "reward" if name.endswith("_rm") else "actor"
    meta = hf_to_mcore(hf_dirs[name], str(tmp_path / "mc"), parallel=TP2PP2, role=role)
    assert meta["value_head"] == (role == "reward")
    out = mcore_to_hf(str(tmp_path / "mc"), str(tmp_path / "hf"))
    assert_same_tensors(hf_dirs[name], out)
    assert load_json(f"{out}/config.json") == load_json(f"{hf_dirs[name]}/config.json")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert os.path.isfile(os.path.join(out, f))


def _archives(ckpt: str):
    """Each stored tensor's torch.save archive in a torch_dist checkpoint, as bytes."""
    from megarlhf.convert.mcore_io import CheckpointReader

    reader = CheckpointReader(ckpt)
    for index, info in reader.metadata.storage_data.items():
        if reader.shape(index.fqn) is not None:
            with open(os.path.join(ckpt, info.relative_path), "rb") as f:
                f.seek(info.offset)
                yield index.fqn, f.read(info.length)


def test_converted_chunks_are_torch_save_archives_with_valid_crc32(hf_dirs, tmp_path):
    """The converter writes each chunk's data record itself (CRC32 from zlib in a second
    thread): every archive must pass zipfile's CRC check and equal what torch.save writes for
    the same tensor, record by record (all but the random serialization id)."""
    hf_to_mcore(hf_dirs["qwen2"], str(tmp_path / "mc"), parallel=TP2PP2)
    count = 0
    for key, archive in _archives(str(tmp_path / "mc")):
        ours = zipfile.ZipFile(io.BytesIO(archive))
        assert ours.testzip() is None, key  # reads every record, checks its CRC32
        tensor = torch.load(io.BytesIO(archive), weights_only=True)
        reference = io.BytesIO()
        torch.save(tensor, reference)
        torch_own = zipfile.ZipFile(reference)
        names = [i.filename for i in torch_own.infolist()]
        assert [i.filename for i in ours.infolist()] == names, key
        for name in names:
            if not name.endswith("serialization_id"):
                assert ours.read(name) == torch_own.read(name), (key, name)
                assert ours.getinfo(name).CRC == torch_own.getinfo(name).CRC, (key, name)
        assert len(archive) == len(reference.getvalue()), key
        count += 1
    assert count > 10


@pytest.mark.parametrize("tensor", [torch.randn(3, 5), torch.arange(6.0).to(torch.bfloat16),
                                    torch.randn(4, 6).t(), torch.randn(10)[2:7], torch.ones(0)],
                         ids=["fp32", "bf16", "transposed", "view", "empty"])
def test_chunk_archive_of_any_tensor_loads_back(tmp_path, tensor):
    from megarlhf.convert.chunk_file import write_tensor_archive

    path = str(tmp_path / "file")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    with concurrent.futures.ThreadPoolExecutor(1) as crc_thread:
        length = write_tensor_archive(fd, 5, tensor, crc_thread)
    os.close(fd)
    with open(path, "rb") as f:
        archive = f.read()[5:]
    assert len(archive) == length
    assert zipfile.ZipFile(io.BytesIO(archive)).testzip() is None
    loaded = torch.load(io.BytesIO(archive), weights_only=True)
    assert loaded.dtype == tensor.dtype and torch.equal(loaded, tensor)


def test_reader_views_and_reads_into_equal_plain_reads(tmp_path):
    src = hf_models.save_model(str(tmp_path / "src"), "qwen2", dtype=torch.bfloat16)
    reader = SafetensorsReader(src)
    for name in reader.names():
        plain = reader.get(name)
        assert reader.view(name).dtype == torch.bfloat16
        assert torch.equal(reader.view(name), plain), name
        into = torch.empty(reader.shape(name), dtype=reader.dtype(name))
        assert reader.get(name, out=into) is into and torch.equal(into, plain), name
    with pytest.raises(ValueError, match="cannot read it into a"):
        reader.get(name, out=torch.empty(3))


def test_conversion_holds_one_tensor_at_a_time(hf_dirs, tmp_path):
    """Streaming: the CPU tensors alive at once never exceed the largest Megatron tensor,
    here the embedding with its vocab padding (300 -> 384 rows), which is read straight into
    its padded rows. Two chunks held at once, or padding added by a copy, would double it.
    (Toy sizes: q/k/v and their fused copy, the largest per-layer pair, are 64 KiB.)"""
    from tests.live_bytes import LiveBytes

    model = ModelConfig.from_dict(hf_to_mcore(hf_dirs["llama"], str(tmp_path / "warm"),
                                              parallel=ParallelConfig())["model"])
    rows = model.padded_vocab_size(1)  # the checkpoint is layout-free: padded as at TP1
    assert rows > model.vocab_size
    padded = rows * model.hidden_size * 4
    with LiveBytes() as live:
        hf_to_mcore(hf_dirs["llama"], str(tmp_path / "mc"), parallel=ParallelConfig())
    assert padded <= live.peak <= padded + 4096, (live.peak, padded)


def test_bf16_is_preserved_and_exports_to_other_dtypes(tmp_path):
    src = hf_models.save_model(str(tmp_path / "src"), "llama", dtype=torch.bfloat16)
    meta = hf_to_mcore(src, str(tmp_path / "mc"), parallel=ParallelConfig())
    assert meta["dtype"] == "bf16"
    assert_same_tensors(src, mcore_to_hf(str(tmp_path / "mc"), str(tmp_path / "same")))
    fp32 = mcore_to_hf(str(tmp_path / "mc"), str(tmp_path / "fp32"), dtype="fp32")
    a, b = SafetensorsReader(src), SafetensorsReader(fp32)
    for name in a.names():
        assert b.dtype(name) == torch.float32 and torch.equal(a.get(name).float(), b.get(name))
    assert load_json(f"{fp32}/config.json")["dtype"] == "float32"


def test_sharded_export_loads_in_transformers_and_generates(hf_dirs, tmp_path):
    hf_to_mcore(hf_dirs["qwen2"], str(tmp_path / "mc"), parallel=TP2PP2)
    out = mcore_to_hf(str(tmp_path / "mc"), str(tmp_path / "hf"), max_shard_bytes=100_000)
    index = load_json(f"{out}/model.safetensors.index.json")
    assert len(set(index["weight_map"].values())) > 2
    original = transformers.AutoModelForCausalLM.from_pretrained(hf_dirs["qwen2"])
    exported = transformers.AutoModelForCausalLM.from_pretrained(out)
    prompt = torch.tensor([[5, 17, 42, 99]])
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    assert torch.equal(original.generate(prompt, **kwargs), exported.generate(prompt, **kwargs))
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.pad_token == "<pad>"


def test_critic_from_a_causal_lm_needs_asking_and_exports_as_sequence_classifier(hf_dirs,
                                                                                 tmp_path):
    with pytest.raises(ValueError, match="--init-value-head"):
        hf_to_mcore(hf_dirs["llama"], str(tmp_path / "mc"), parallel=ParallelConfig(),
                    role="critic")
    assert not os.path.exists(tmp_path / "mc")
    meta = hf_to_mcore(hf_dirs["llama"], str(tmp_path / "mc"), parallel=ParallelConfig(),
                       role="critic", init_value_head=True, seed=3)
    assert meta["value_head"] and meta["extra"]["fresh_value_head"]
    out = mcore_to_hf(str(tmp_path / "mc"), str(tmp_path / "hf"))
    assert load_json(f"{out}/config.json")["architectures"] == ["LlamaForSequenceClassification"]
    model = transformers.AutoModelForSequenceClassification.from_pretrained(out)
    assert model.score.weight.shape == (1, 64)
    assert 0.01 < model.score.weight.std().item() < 0.04  # initialised with init_std 0.02
    original = SafetensorsReader(hf_dirs["llama"])
    exported = SafetensorsReader(out)
    for name in original.names():
        if name != "lm_head.weight":
            assert torch.equal(original.get(name), exported.get(name)), name


def test_sequence_classifier_is_not_an_actor(hf_dirs, tmp_path):
    with pytest.raises(ValueError, match="critic or reward"):
        hf_to_mcore(hf_dirs["llama_rm"], str(tmp_path / "mc"), parallel=ParallelConfig())


def test_layout_errors_come_before_any_output(hf_dirs, tmp_path):
    out = str(tmp_path / "mc")
    with pytest.raises(ValueError, match="does not divide num_kv_heads=2"):
        hf_to_mcore(hf_dirs["llama"], out, parallel=ParallelConfig(tensor_parallel=4))
    with pytest.raises(ValueError, match="num_layers=4 is not divisible"):
        hf_to_mcore(hf_dirs["llama"], out, parallel=ParallelConfig(pipeline_parallel=3))
    assert not os.listdir(tmp_path)


def test_existing_output_is_refused_without_force_and_kept_intact(hf_dirs, tmp_path):
    out = str(tmp_path / "mc")
    hf_to_mcore(hf_dirs["llama"], out, parallel=ParallelConfig())
    before = read_meta(out)
    with pytest.raises(ValueError, match="already exists; pass --force"):
        hf_to_mcore(hf_dirs["qwen3"], out, parallel=ParallelConfig())
    assert read_meta(out) == before
    hf_to_mcore(hf_dirs["qwen3"], out, parallel=ParallelConfig(), force=True)
    assert read_meta(out)["architecture"] == "qwen3"
    assert sorted(os.listdir(tmp_path)) == ["mc"]


def test_truncated_checkpoint_names_the_tensor(hf_dirs, tmp_path):
    src = str(tmp_path / "src")
    shutil.copytree(hf_dirs["llama"], src)
    path = os.path.join(src, "model.safetensors")
    os.truncate(path, os.path.getsize(path) - 1000)
    with pytest.raises(ValueError, match=r"truncated: tensor .* \(shape \("):
        hf_to_mcore(src, str(tmp_path / "mc"), parallel=ParallelConfig())
    assert not os.path.exists(tmp_path / "mc") and not os.path.exists(tmp_path / "mc.tmp")


def test_checkpoint_not_matching_its_config_names_tensor_and_shapes(hf_dirs, tmp_path):
    src = str(tmp_path / "src")
    shutil.copytree(hf_dirs["llama"], src)
    config = load_json(f"{src}/config.json")
    config["num_key_value_heads"] = 1
    with open(f"{src}/config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=r"k_proj.weight has shape \(32, 64\) but config.json "
                                         r"implies \(16, 64\)"):
        hf_to_mcore(src, str(tmp_path / "mc"), parallel=ParallelConfig())


def test_missing_and_unknown_inputs(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        hf_to_mcore(str(tmp_path), str(tmp_path / "mc"), parallel=ParallelConfig())
    with pytest.raises(ValueError, match="not a complete megarlhf checkpoint"):
        mcore_to_hf(str(tmp_path), str(tmp_path / "hf"))


@pytest.mark.parametrize("ours, hf_fp32, passed", [
    (9e-5, 1e-6, True),      # within the tolerance of float64
    (1.4e-4, 1.7e-4, True),  # over it, but no worse than HF's own fp32 (SmolLM2, TP3xPP2)
    (3.5e-4, 1.7e-4, False),  # over twice HF's own fp32 error
    (5e-3, 1e-5, False),     # a mapping error
    (float("nan"), 1e-5, False),
])
def test_verify_passes_within_tolerance_or_hf_own_fp32_error(ours, hf_fp32, passed):
    report = VerifyReport("logits", ours, hf_fp32, 1.0, tolerance=1e-4, layout="TP3xPP2")
    assert report.passed == passed
    assert report.bound == max(1e-4, HF_FP32_FACTOR * hf_fp32)


def test_verify_compares_with_hf_float64_and_reports_both_differences():
    # Logits [B=2, T=3, V=4] whose float64 values fp32 misses by 1.7e-4 and ours by 1.4e-4.
    fp64 = torch.arange(24, dtype=torch.float64).reshape(2, 3, 4) / 8  # fp32 rounds by <= 1.2e-7
    hf = HFOutputs(fp32=(fp64 + 1.7e-4).float(), fp64=fp64)
    tokens = torch.zeros(2, 3, dtype=torch.long)
    report = compare(hf, (fp64 - 1.4e-4).float(), tokens, value_head=False, pad_id=None,
                     tolerance=1e-4, layout="TP3xPP2")
    assert report.ours_diff == pytest.approx(1.4e-4, rel=1e-2)
    assert report.hf_fp32_diff == pytest.approx(1.7e-4, rel=1e-2)
    assert report.passed and report.top1_agreement == 1.0
    assert str(report).splitlines() == [
        "PASS logits at TP3xPP2: max |diff| from HF float64: ours 1.40e-04, HF fp32 1.70e-04; "
        "top-1 agreement 1.0000",
        "  rule: ours <= max(tolerance 1.0e-04, 2 x HF fp32) = 3.40e-04"]
    # Scores: ours per token, HF's at each row's last non-pad token (pad id 0).
    tokens = torch.tensor([[5, 6, 7], [5, 6, 0]])
    hf = HFOutputs(fp32=torch.tensor([1.0, 2.0]), fp64=torch.tensor([1.0, 2.0],
                                                                    dtype=torch.float64))
    ours = torch.tensor([[9.0, 9.0, 1.0], [9.0, 2.5, 9.0]])
    report = compare(hf, ours, tokens, value_head=True, pad_id=0, tolerance=1e-4, layout="TP1")
    assert (report.kind, report.ours_diff, report.hf_fp32_diff) == ("scores", 0.5, 0.0)
    assert not report.passed and str(report).startswith("FAIL scores at TP1: ")
