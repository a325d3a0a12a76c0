"""Bad configurations fail at construction with a ValueError that names the numbers."""

from __future__ import annotations

import dataclasses

import pytest

from megarlhf.engine.optim import OptimConfig
from megarlhf.models.config import ModelConfig, RopeScaling
from megarlhf.models.presets import preset
from megarlhf.models import specs
from megarlhf.models.specs import resolve_layer_spec
from megarlhf.models.transformer_config import parse_dtype, to_transformer_config
from megarlhf.parallel.mesh import DistEnv, ParallelConfig, init_mesh


def test_world_size_not_divisible_by_tp_pp():
    with pytest.raises(ValueError, match=r"world size 6 .* 2 x 2 x 1 = 4"):
        ParallelConfig(tensor_parallel=2, pipeline_parallel=2).data_parallel_size(6)
    # CP ranks hold one replica between them, like TP and PP ranks.
    with pytest.raises(ValueError, match=r"world size 6 .* x context_parallel = 2 x 1 x 2 = 4"):
        ParallelConfig(tensor_parallel=2, context_parallel=2).data_parallel_size(6)
    assert ParallelConfig(context_parallel=2).data_parallel_size(8) == 4
    # init_mesh refuses before any process group is created.
    env = DistEnv(rank=0, world_size=6, local_rank=0, master_addr="127.0.0.1", master_port=1)
    with pytest.raises(ValueError, match="world size 6"):
        init_mesh(ParallelConfig(tensor_parallel=4), env)


def test_data_parallel_size():
    assert ParallelConfig(tensor_parallel=2, pipeline_parallel=2).data_parallel_size(8) == 2


def test_expert_groups_must_divide_each_stage():
    # EP x expert-TP regroups a stage's TP x CP x DP ranks; it adds no world dimension.
    assert ParallelConfig(expert_parallel=2).data_parallel_size(2) == 2
    assert ParallelConfig(tensor_parallel=2, expert_parallel=2).data_parallel_size(2) == 1
    with pytest.raises(ValueError, match=r"expert_parallel x expert_tensor_parallel = 2 x 2 "
                                         r"does not divide the 2 ranks of a pipeline stage"):
        ParallelConfig(expert_parallel=2, expert_tensor_parallel=2).data_parallel_size(2)
    assert ParallelConfig(expert_parallel=2, expert_tensor_parallel=2).data_parallel_size(4) == 4
    assert ParallelConfig(expert_parallel=2, expert_tensor_parallel=2).min_data_parallel == 4
    assert ParallelConfig(tensor_parallel=2, expert_parallel=4).min_data_parallel == 2
    assert ParallelConfig(tensor_parallel=4, expert_parallel=2).min_data_parallel == 1
    # Unset, expert-TP is TP without EP (experts split like any MLP) and 1 with it.
    assert ParallelConfig(tensor_parallel=2).expert_tp == 2
    assert ParallelConfig(tensor_parallel=2, expert_parallel=2).expert_tp == 1


def test_layouts_that_resolve_alike_share_a_mesh():
    # Roles on the same ranks: expert-TP compared as resolved (unset = 1 under EP), sequence
    # parallelism being each model's own flag.
    ep2 = ParallelConfig(tensor_parallel=2, sequence_parallel=True, expert_parallel=2)
    assert ep2.same_mesh(dataclasses.replace(ep2, expert_tensor_parallel=1,
                                             sequence_parallel=False))
    assert not ep2.same_mesh(dataclasses.replace(ep2, expert_tensor_parallel=2))
    assert ParallelConfig(tensor_parallel=2).same_mesh(
        ParallelConfig(tensor_parallel=2, expert_tensor_parallel=2))


def test_experts_must_divide_over_expert_ranks():
    moe = dataclasses.replace(preset("tiny"), num_experts=6, moe_ffn_hidden_size=30)
    with pytest.raises(ValueError, match="expert_parallel=4 does not divide num_experts=6"):
        moe.check_parallel(ParallelConfig(expert_parallel=4))
    with pytest.raises(ValueError, match="expert_tensor_parallel=4 does not divide .* "
                                         "moe_ffn_hidden_size=30"):
        moe.check_parallel(ParallelConfig(expert_parallel=2, expert_tensor_parallel=4))
    with pytest.raises(ValueError, match="need a mixture-of-experts model"):
        preset("tiny").check_parallel(ParallelConfig(expert_parallel=2))
    # A dense model on an MoE model's ranks (a reward model beside a Mixtral actor) has no
    # experts to split: its megatron config runs at EP1.
    dense = to_transformer_config(preset("tiny"), ParallelConfig(tensor_parallel=2,
                                                                 expert_parallel=2))
    assert (dense.expert_model_parallel_size, dense.num_moe_experts) == (1, None)
    # megatron-core's MoE layer trains at TP > 1 only with sequence parallelism.
    tp2 = ParallelConfig(tensor_parallel=2)
    moe.check_parallel(tp2)
    with pytest.raises(ValueError, match="trains at tensor_parallel=2 only with "
                                         "sequence_parallel=True"):
        moe.check_parallel(tp2, training=True)
    with pytest.raises(ValueError, match="moe_router_topk .7. exceeds num_experts .6."):
        dataclasses.replace(moe, moe_router_topk=7)


@pytest.mark.parametrize("kwargs, match", [
    ({"tensor_parallel": 0}, "tensor_parallel must be a positive integer"),
    ({"virtual_pipeline_parallel": 2}, "needs pipeline_parallel >= 2"),
    ({"sequence_parallel": True}, "needs tensor_parallel > 1"),
    ({"expert_parallel": 0}, "expert_parallel must be a positive integer"),
    ({"expert_parallel": 2, "expert_tensor_parallel": 0},
     "expert_tensor_parallel must be a positive integer"),
    # Without EP, megatron-core reduces expert gradients as dense ones: experts split over TP.
    ({"tensor_parallel": 2, "expert_tensor_parallel": 1}, "at expert_parallel=1: without EP"),
])
def test_parallel_config_rejects(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**kwargs)


def test_tp_must_divide_heads_and_kv_heads():
    tiny = preset("tiny")  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match="tensor_parallel=3 does not divide num_attention_heads=4"):
        tiny.check_parallel(ParallelConfig(tensor_parallel=3))
    with pytest.raises(ValueError, match="tensor_parallel=4 does not divide num_kv_heads=2"):
        tiny.check_parallel(ParallelConfig(tensor_parallel=4))


def test_layers_must_divide_across_pp_and_vpp():
    tiny = preset("tiny")  # 4 layers
    with pytest.raises(ValueError, match=r"num_layers=4 .* 3 x 1 = 3"):
        tiny.check_parallel(ParallelConfig(pipeline_parallel=3))
    with pytest.raises(ValueError, match=r"num_layers=4 .* 2 x 4 = 8"):
        to_transformer_config(tiny, ParallelConfig(pipeline_parallel=2,
                                                   virtual_pipeline_parallel=4))


def test_unknown_layer_spec_and_dtype(monkeypatch):
    with pytest.raises(ValueError, match="unknown layer spec 'flash'"):
        resolve_layer_spec("flash", on_gpu=False)
    with pytest.raises(ValueError, match="needs a GPU and Transformer Engine"):
        resolve_layer_spec("te", on_gpu=False)
    assert resolve_layer_spec("auto", on_gpu=False) == "sdpa"
    # auto never picks Transformer Engine, installed or not: it is not verified here.
    monkeypatch.setattr(specs, "te_available", lambda: True)
    assert resolve_layer_spec("auto", on_gpu=True) == "sdpa"
    assert resolve_layer_spec("te", on_gpu=True) == "te"  # by name (bench/gpu's TE item)
    # Context parallelism runs our gathered-KV attention, never Transformer Engine's.
    assert resolve_layer_spec("auto", on_gpu=True, context_parallel=2) == "sdpa"
    assert resolve_layer_spec("auto", on_gpu=False, context_parallel=2) == "sdpa"
    with pytest.raises(ValueError, match="context_parallel=2 runs with the 'sdpa' or 'local'"):
        resolve_layer_spec("te", on_gpu=True, context_parallel=2)
    with pytest.raises(ValueError, match="context_parallel must be a positive integer"):
        ParallelConfig(context_parallel=0)
    assert ParallelConfig(context_parallel=2).sequence_multiple == 4
    assert ParallelConfig(tensor_parallel=2, sequence_parallel=True,
                          context_parallel=2).sequence_multiple == 8
    assert ParallelConfig(tensor_parallel=2, sequence_parallel=True).sequence_multiple == 2
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        parse_dtype("fp8")


def test_transformer_engine_is_refused_until_verified(tmp_path):
    from megarlhf.data.config import DataConfig, DatasetSource
    from megarlhf.ppo.config import PPOConfig
    from megarlhf.sft.config import LoopConfig, ModelSource, SFTConfig

    with pytest.raises(ValueError, match="layer_spec='te': Transformer Engine is not verified"):
        PPOConfig(actor="a", prompts="p", out_dir="o", reward_fn="m:f", layer_spec="te")
    with pytest.raises(ValueError, match=r"layer_spec='flash' is not one of \['auto', 'local'"):
        PPOConfig(actor="a", prompts="p", out_dir="o", reward_fn="m:f", layer_spec="flash")
    data = tmp_path / "sft.jsonl"
    data.write_text('{"prompt": "a", "response": "b"}\n')
    sft = dict(data=DataConfig(train=DatasetSource(path=str(data)), max_length=16),
               train=LoopConfig(output_dir=str(tmp_path / "out"), steps=1,
                                global_batch_size=1, micro_batch_size=1))
    with pytest.raises(ValueError, match="model.layer_spec 'te': Transformer Engine is not"):
        SFTConfig(model=ModelSource(preset="tiny", layer_spec="te"), pack=False, **sft)


def test_model_config_rejects():
    base = dict(vocab_size=100, hidden_size=64, ffn_hidden_size=128, num_layers=2)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        ModelConfig(**base, num_attention_heads=4, num_kv_heads=3)
    with pytest.raises(ValueError, match="set head_dim explicitly"):
        ModelConfig(**base, num_attention_heads=6)
    with pytest.raises(ValueError, match="unsupported RoPE scaling type 'yarn'"):
        RopeScaling(rope_type="yarn")
    # Qwen3-style head_dim independent of hidden / heads is accepted.
    assert ModelConfig(**base, num_attention_heads=6, head_dim=32).kv_channels == 32


def test_padded_vocab():
    tiny = dataclasses.replace(preset("tiny"), vocab_size=300, make_vocab_size_divisible_by=16)
    assert tiny.padded_vocab_size(1) == 304
    assert tiny.padded_vocab_size(2) == 320


def test_optim_config_rejects():
    with pytest.raises(ValueError, match="decay_steps"):
        OptimConfig(warmup_steps=10, decay_steps=5)
    with pytest.raises(ValueError, match="lr_decay_style"):
        OptimConfig(lr_decay_style="step")


def test_transformer_config_translation():
    tiny = preset("tiny")
    cfg = to_transformer_config(tiny, ParallelConfig(tensor_parallel=2, pipeline_parallel=2))
    assert (cfg.num_query_groups, cfg.kv_channels, cfg.gated_linear_unit) == (2, 16, True)
    assert cfg.normalization == "RMSNorm" and cfg.layernorm_epsilon == tiny.norm_eps
    assert cfg.tensor_model_parallel_size == 2 and cfg.pipeline_model_parallel_size == 2
    assert cfg.batch_p2p_comm is False  # gloo: batched p2p swaps micro-batches
    assert cfg.calculate_per_token_loss is True


def test_recompute_modes_translate_to_megatron_core():
    """'full' recomputes every layer from its input, one layer per unit; 'selective' the core
    attention only, named here rather than left to megatron-core's default list (which later
    versions may change). tests/test_roles.py and tests/test_ppo.py train with both."""
    tiny, tp2 = preset("tiny"), ParallelConfig(tensor_parallel=2)
    none = to_transformer_config(tiny, tp2)
    assert none.recompute_granularity is None and none.recompute_method is None
    full = to_transformer_config(tiny, tp2, recompute="full")
    assert (full.recompute_granularity, full.recompute_method, full.recompute_num_layers) == \
        ("full", "uniform", 1)
    selective = to_transformer_config(tiny, tp2, recompute="selective")
    assert (selective.recompute_granularity, selective.recompute_method,
            selective.recompute_num_layers, selective.recompute_modules) == \
        ("selective", None, None, ["core_attn"])
    with pytest.raises(ValueError, match=r"recompute='block' is not one of \['none', 'full', "
                                         r"'selective'\]"):
        to_transformer_config(tiny, tp2, recompute="block")


def test_the_megatron_engine_refuses_a_sequence_parallel_model():
    """The colocated engine is built from the group's mesh, without sequence parallelism; a
    model spec with it is refused (megatron-core's static KV cache cannot run it)."""
    import types

    from megarlhf.models.gpt import model_spec
    from megarlhf.rollout.megatron_engine import _check_layout

    tiny, tp2 = preset("tiny"), ParallelConfig(tensor_parallel=2)
    mesh = types.SimpleNamespace(pp=1, tp=2, cp=1, ep=1, config=tp2)
    _check_layout(model_spec(tiny, tp2, on_gpu=False), mesh)
    with pytest.raises(ValueError, match="sequence_parallel=True: megatron-core's static KV "
                                         "cache does not support it"):
        _check_layout(model_spec(tiny, dataclasses.replace(tp2, sequence_parallel=True),
                                 on_gpu=False), mesh)
    # Nor does its KV cache split sequences over CP ranks.
    cp2 = dataclasses.replace(tp2, context_parallel=2)
    with pytest.raises(ValueError, match="context_parallel=2: the engine's KV cache holds"):
        _check_layout(model_spec(tiny, cp2, on_gpu=False),
                      types.SimpleNamespace(pp=1, tp=2, cp=2, ep=1, config=cp2))
    # Nor can expert-parallel ranks, which run every forward together, stop on their own.
    moe = dataclasses.replace(tiny, num_experts=4, moe_ffn_hidden_size=32)
    ep2 = dataclasses.replace(tp2, expert_parallel=2)
    with pytest.raises(ValueError, match="expert_parallel=2: expert-parallel ranks must run"):
        _check_layout(model_spec(moe, ep2, on_gpu=False),
                      types.SimpleNamespace(pp=1, tp=2, cp=1, ep=2, config=ep2))
