"""The resharding bridge against the converter's HF export (multi-process, gloo).

Equality is bitwise: the bridge and the exporter move the same numbers (fp32, or the same
round-to-nearest cast to bf16) and must not compute anything.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from safetensors.torch import load_file

from megarlhf.convert.hf_to_mcore import hf_to_mcore
from megarlhf.convert.mcore_to_hf import mcore_to_hf
from megarlhf.models.presets import preset
from megarlhf.parallel import launch_local
from megarlhf.parallel.mesh import ParallelConfig, free_port
from tests import bridge_workers, hf_models, workers

pytestmark = pytest.mark.slow
NAMES = ["llama", "qwen2", "qwen3"]  # GQA + Llama-3 RoPE; tied embeddings + bias; QK-norm
BUCKET = 64 * 1024  # small enough that every toy model streams in several buckets


def _export(ckpt: str, out: str, dtype: str | None = None) -> dict[str, torch.Tensor]:
    import glob

    mcore_to_hf(ckpt, out, dtype=dtype)
    tensors = {}
    for path in sorted(glob.glob(f"{out}/*.safetensors")):
        tensors.update(load_file(path))
    return tensors


def assert_bitwise(streamed: dict, exported: dict) -> None:
    assert sorted(streamed) == sorted(exported)
    for name, tensor in exported.items():
        assert streamed[name].dtype == tensor.dtype, name
        assert torch.equal(streamed[name], tensor), name


@pytest.fixture(scope="module")
def checkpoints(hf_dirs, tmp_path_factory):
    """TP2xPP2 checkpoints of toy HF models and their HF exports (fp32 and bf16)."""
    root = tmp_path_factory.mktemp("bridge")
    out = {}
    for name in NAMES:
        ckpt = str(root / name)
        hf_to_mcore(hf_dirs[name], ckpt, parallel=ParallelConfig(tensor_parallel=2,
                                                                 pipeline_parallel=2))
        out[name] = (ckpt, _export(ckpt, str(root / f"{name}_hf")))
    out["llama_bf16"] = _export(out["llama"][0], str(root / "llama_bf16"), dtype="bf16")
    return out


LAYOUTS = {
    "TP2xPP2": ParallelConfig(tensor_parallel=2, pipeline_parallel=2),
    # Without pipeline stages the stream hands out views of parameters and gathered tensors.
    "TP2xDP2": ParallelConfig(tensor_parallel=2),
    "PP2xVPP2xDP2": ParallelConfig(pipeline_parallel=2, virtual_pipeline_parallel=2),
}


@pytest.fixture(scope="module")
def colocated_streams(checkpoints):
    """Per-rank colocated streams, {(dtype, layout): results}: the first look-up runs every
    case below on one set of 4 ranks (each case builds its own mesh and engines there, as a
    launch of its own would), saving the start-up of a launch per case."""
    cases = {("fp32", layout): ([checkpoints[n][0] for n in NAMES], LAYOUTS[layout], BUCKET)
             for layout in LAYOUTS}
    for layout in ("TP2xPP2", "TP2xDP2"):
        cases["bf16", layout] = ([checkpoints["llama"][0]], LAYOUTS[layout], BUCKET,
                                 torch.bfloat16, True)
    cache: dict = {}

    def get(key):
        if not cache:
            per_rank = launch_local(workers.in_sequence, 4, [
                (bridge_workers.colocated, case, {}) for case in cases.values()])
            for i, k in enumerate(cases):
                cache[k] = [outs[i] for outs in per_rank]
        return cache[key]
    return get


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_colocated_stream_equals_export(checkpoints, colocated_streams, layout):
    results = colocated_streams(("fp32", layout))
    for rank, per_ckpt in enumerate(results):
        for name, (streamed, bucket_bytes) in zip(NAMES, per_ckpt):
            assert_bitwise(streamed, checkpoints[name][1])
            assert len(bucket_bytes) > 3, name
            # Only a single tensor larger than the bucket may exceed it (alone in its bucket).
            largest = max(t.numel() * t.element_size() for t in streamed.values())
            assert max(bucket_bytes) <= max(BUCKET, largest), (rank, name)


@pytest.mark.parametrize("layout", ["TP2xPP2", "TP2xDP2"])
def test_colocated_stream_casts_like_export_with_a_reused_buffer(checkpoints, colocated_streams,
                                                                 layout):
    results = colocated_streams(("bf16", layout))
    for per_ckpt in results:
        assert_bitwise(per_ckpt[0][0], checkpoints["llama_bf16"])


def test_disaggregated_stream_reaches_every_engine_rank(checkpoints):
    """TP2xPP2 trainer (4 ranks) -> an inference-TP2 engine in 2 other processes."""
    ckpt, exported = checkpoints["qwen2"]
    results = launch_local(bridge_workers.disaggregated, 6, ckpt, LAYOUTS["TP2xPP2"], 4,
                           free_port(), free_port(), BUCKET)
    assert results[:4] == [None] * 4
    for streamed, bucket_bytes in results[4:]:
        assert_bitwise(streamed, exported)
        assert len(bucket_bytes) > 3


# Mixture of experts: each EP rank holds its experts, which the EP group's other ranks get by
# broadcast; under expert-TP an expert's matrices are gathered over its expert-TP group first.
MOE_LAYOUTS = {
    "TP2xEP2": ParallelConfig(tensor_parallel=2, sequence_parallel=True, expert_parallel=2),
    "PP2xEP2": ParallelConfig(pipeline_parallel=2, expert_parallel=2),
    "EP2xETP2": ParallelConfig(expert_parallel=2, expert_tensor_parallel=2),
    "EP4": ParallelConfig(expert_parallel=4),
}


@pytest.fixture(scope="module")
def moe_checkpoints(hf_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("bridge_moe")
    out = {}
    for name in hf_models.MOE_ARCHS:
        ckpt = str(root / name)
        hf_to_mcore(hf_dirs[name], ckpt, parallel=ParallelConfig())
        out[name] = (ckpt, _export(ckpt, str(root / f"{name}_hf")))
    return out


def test_moe_colocated_streams_equal_export(moe_checkpoints):
    names = list(hf_models.MOE_ARCHS)
    ckpts = [moe_checkpoints[n][0] for n in names]
    per_rank = launch_local(workers.in_sequence, 4, [
        (bridge_workers.colocated, (ckpts, parallel, BUCKET), {})
        for parallel in MOE_LAYOUTS.values()])
    for rank, per_layout in enumerate(per_rank):
        for layout, per_ckpt in zip(MOE_LAYOUTS, per_layout):
            for name, (streamed, _) in zip(names, per_ckpt):
                assert_bitwise(streamed, moe_checkpoints[name][1])


def test_moe_disaggregated_stream_gathers_every_expert(moe_checkpoints):
    """An EP2 trainer (2 ranks, each holding half the experts) -> a 1-process engine: the
    replica that sends needs the other replica's experts."""
    ckpt, exported = moe_checkpoints["mixtral"]
    results = launch_local(bridge_workers.disaggregated, 3, ckpt,
                           ParallelConfig(expert_parallel=2), 2, free_port(), free_port(), BUCKET)
    assert results[:2] == [None] * 2
    assert_bitwise(results[2][0], exported)


def test_stream_peak_memory_within_bound(tmp_path):
    """A model 6x the bound: gathering it whole would break the bound, streaming must not."""
    model = dataclasses.replace(preset("tiny"), hidden_size=256, ffn_hidden_size=1024,
                                num_layers=12, vocab_size=1000, num_attention_heads=4)
    ckpt = str(tmp_path / "ref")
    launch_local(workers.write_reference, 1, ckpt, model, 0)
    results = launch_local(bridge_workers.stream_peak_bytes, 2, ckpt,
                           ParallelConfig(tensor_parallel=2), 2 * 1024**2)
    for peak, bound, model_bytes in results:
        assert bound * 5 < model_bytes, (bound, model_bytes)
        assert 0 < peak <= bound, (peak, bound)


def test_bridge_refuses_what_it_cannot_map(checkpoints, hf_dirs, tmp_path):
    reward = str(tmp_path / "reward")
    hf_to_mcore(hf_dirs["llama_rm"], reward, parallel=ParallelConfig(), role="reward")
    messages = launch_local(bridge_workers.refusals, 1, {
        "value model": (reward, {}),
        "missing tensor": (checkpoints["llama"][0], {"qk_norm": True}),
        "other shape": (checkpoints["llama"][0], {"ffn_hidden_size": 96}),
    })[0]
    assert "value_head.linear.weight" in messages["value model"]
    assert "q_layernorm" in messages["missing tensor"]
    assert "linear_fc1.weight" in messages["other shape"] and "(256, 64)" in messages["other shape"]


def test_the_projection_read_back_names_a_row_the_engine_computes_differently():
    """rollout/projection.py: an engine's products equal to the streamed tensor's within the
    dtype's rounding pass; one row pushed down is named, at its global vocabulary index."""
    from megarlhf.rollout import projection
    from megarlhf.rollout.engine import EngineError

    g = torch.Generator().manual_seed(0)
    head = torch.randn(100, 64, generator=g)
    recorder = projection.Recorder("lm_head.weight")
    stream = [[("model.norm.weight", torch.ones(64))], [("lm_head.weight", head)]]
    assert list(recorder.wrap(iter(stream))) == stream  # passed through unchanged
    probe = projection.vectors(64)
    # A TP rank holding rows 50..99: its own GEMM (bf16 weights, output rounded to bf16).
    engine = (head[50:].bfloat16() @ probe.bfloat16()).float()
    # bf16's rounding (~8e-4 of |row| x |vector|) is over fp32's bound and under bf16's.
    with pytest.raises(EngineError, match=r"largest error 0.000[0-9]+, tolerance 0.0001"):
        recorder.check("engine", 50, engine, torch.float32)
    recorder.check("engine", 50, engine, torch.bfloat16)
    broken = head[50:].clone()
    broken[7] = -50 * broken[7].abs()
    with pytest.raises(EngineError, match=r"in 1 vocabulary row\(s\) \(first \[57\]"):
        recorder.check("engine", 50, broken @ probe, torch.float32)
    recorder.check("engine", 50, head[50:] @ probe, torch.float32)
    with pytest.raises(EngineError, match="carried no lm_head.weight"):
        projection.Recorder("lm_head.weight").check("engine", 0, engine, torch.float32)
