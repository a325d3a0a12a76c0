"""LoRA adapters (models/lora.py): config checks, the fused layers against per-projection
plain-torch maths, and what trains."""

from __future__ import annotations

import math

import pytest
import torch
from megatron.core import tensor_parallel

from megarlhf.models.arch.llama_family import _fuse_qkv
from megarlhf.models.gpt import build_model, model_spec
from megarlhf.models.lora import LoraConfig
from megarlhf.models.presets import preset
from megarlhf.parallel.mesh import ParallelConfig
from tests.fake_world import fake_rank


@pytest.mark.parametrize("bad, message", [
    ({"rank": 0}, "lora.rank must be >= 1"),
    ({"alpha": 0.0}, "lora.alpha must be a positive number"),
    ({"target_modules": ["q_proj", "c_attn"]}, "['c_attn']"),
    ({"target_modules": "all"}, "give a list of"),
    ({"init": "pissa"}, "lora.init 'pissa' is not one of"),
])
def test_bad_lora_fields_are_one_line_errors(bad, message):
    with pytest.raises(ValueError) as caught:
        LoraConfig(**bad)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_moe_mlp_targets_are_refused():
    with pytest.raises(ValueError, match="mixture-of-experts MLP"):
        model_spec(preset("mixtral-8x7b"), ParallelConfig(), lora=LoraConfig(), on_gpu=False)


def _reference(x, weight, adapters, scale, layout):
    """W x plus each projection's scale * B_p A_p x placed in its rows of the fused output,
    the rows arranged by `layout` (the converters' fusion of HF projections)."""
    flat = x.reshape(-1, x.shape[-1])
    deltas = [scale * (flat @ a.t() @ b.t()) for a, b in adapters]
    fused = torch.cat(layout([d.t() for d in deltas]), dim=0).t()
    return (flat @ weight.t() + fused).reshape(*x.shape[:-1], -1)


@pytest.mark.parametrize("targets", ["all-linear", ("q_proj", "v_proj", "down_proj")])
def test_adapted_layers_equal_per_projection_maths(targets):
    """Every linear layer of the tiny model (GQA: 4 query heads over 2 KV groups) with
    adapters whose B is random: outputs and the gradients of A, B and the input equal the
    per-projection formula in plain torch (fp32, same operations up to summation order:
    1e-5); projections not targeted get no adapter; only adapters require gradients."""
    model = preset("tiny")
    assert model.kv_heads < model.num_attention_heads  # the QKV interleave is exercised
    lora = LoraConfig(rank=3, alpha=5.0, target_modules=targets, init="gaussian")
    with fake_rank(ParallelConfig(), 0) as mesh:
        chunk = build_model(model_spec(model, ParallelConfig(), lora=lora, on_gpu=False),
                            mesh)[0]
        trainable = {n for n, p in chunk.named_parameters() if p.requires_grad}
        assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
        layer = chunk.decoder.layers[1]
        q_rows, _ = _fuse_qkv(model)
        layers = {
            "linear_qkv": (layer.self_attention.linear_qkv, ("q_proj", "k_proj", "v_proj"),
                           q_rows),
            "linear_proj": (layer.self_attention.linear_proj, ("o_proj",), list),
            "linear_fc1": (layer.mlp.linear_fc1, ("gate_proj", "up_proj"), list),
            "linear_fc2": (layer.mlp.linear_fc2, ("down_proj",), list),
        }
        generator = torch.Generator().manual_seed(1)
        for name, (linear, projections, layout) in layers.items():
            wanted = [p for p in projections if p in lora.targets]
            assert sorted(getattr(linear, "lora_A", {})) == sorted(wanted), name
            if not wanted:
                continue
            with torch.no_grad():
                for b in linear.lora_B.values():
                    b.copy_(torch.randn(b.shape, generator=generator))
            x = torch.randn(5, 2, linear.weight.shape[1], generator=generator,
                            requires_grad=True)
            out, _ = linear(x)
            grad_out = torch.randn(out.shape, generator=generator)
            out.backward(grad_out)
            # The reference: every projection, untargeted ones with zero adapters.
            sizes = [t.shape[0] for t in _split_rows(linear.weight, projections, model)]
            adapters = []
            for p, rows in zip(projections, sizes):
                if p in wanted:
                    a = linear.lora_A[p].detach().clone().requires_grad_()
                    b = linear.lora_B[p].detach().clone().requires_grad_()
                else:
                    a, b = torch.zeros(lora.rank, x.shape[-1]), torch.zeros(rows, lora.rank)
                adapters.append((a, b))
            x_ref = x.detach().clone().requires_grad_()
            ref = _reference(x_ref, linear.weight.detach(), adapters, lora.scale, layout)
            ref.backward(grad_out)
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(x.grad, x_ref.grad, atol=1e-5, rtol=1e-5)
            for p, (a, b) in zip(projections, adapters):
                if p in wanted:
                    torch.testing.assert_close(linear.lora_A[p].grad, a.grad, atol=1e-5,
                                               rtol=1e-5)
                    torch.testing.assert_close(linear.lora_B[p].grad, b.grad, atol=1e-5,
                                               rtol=1e-5)
            assert linear.weight.grad is None
            assert lora.scale == 5.0 / 3 and math.isclose(
                LoraConfig(rank=4, alpha=8.0, use_rslora=True).scale, 4.0)


def _split_rows(weight, projections, model):
    """The fused weight's rows per projection (sizes only matter here)."""
    if projections == ("q_proj", "k_proj", "v_proj"):
        return _fuse_qkv(model)[1](weight)
    if len(projections) == 2:
        return list(weight.chunk(2, dim=0))
    return [weight]


def test_adapters_start_at_zero_and_do_not_depend_on_what_a_rank_built():
    """B is zero at the start (the adapted model is the base), and A of a layer is the same
    whether a rank built the whole model or only the second pipeline stage."""
    model = preset("tiny")
    lora = LoraConfig(rank=2)
    with fake_rank(ParallelConfig(), 0) as mesh:
        whole = build_model(model_spec(model, ParallelConfig(), lora=lora, on_gpu=False),
                            mesh)[0]
        last = whole.decoder.layers[-1].self_attention.linear_qkv
        a_whole = last.lora_A["q_proj"].detach().clone()
        assert all(not b.any() for b in last.lora_B.values())
    pp2 = ParallelConfig(pipeline_parallel=2)
    with fake_rank(pp2, 1) as mesh:
        second = build_model(model_spec(model, pp2, lora=lora, on_gpu=False), mesh)[0]
        a_second = second.decoder.layers[-1].self_attention.linear_qkv.lora_A["q_proj"]
        torch.testing.assert_close(a_second.detach(), a_whole, atol=0, rtol=0)
    bound = 1 / math.sqrt(model.hidden_size)  # kaiming-uniform(a=sqrt 5) over the input
    assert a_whole.abs().max() <= bound and a_whole.abs().max() > bound / 2


def test_with_adapters_off_the_model_is_its_base():
    """PPO's reference with LoRA: the adapted model (random B, so the adapters matter) under
    adapters_off gives exactly the logits of a model built without LoRA holding the same
    base weights; outside it the logits differ."""
    from megarlhf.models.lora import adapters_off, is_adapter_key

    model = preset("tiny")
    tokens = torch.randint(0, model.vocab_size, (2, 7), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(7).expand(2, 7)
    with fake_rank(ParallelConfig(), 0) as mesh:
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        adapted = build_model(model_spec(model, ParallelConfig(), on_gpu=False,
                                         lora=LoraConfig(rank=2)), mesh)[0].eval()
        plain = build_model(model_spec(model, ParallelConfig(), on_gpu=False), mesh)[0].eval()
        state = adapted.state_dict()
        plain.load_state_dict({k: v for k, v in state.items() if not is_adapter_key(k)})
        with torch.no_grad():
            for name, param in adapted.named_parameters():
                if ".lora_B." in name:
                    param.normal_()
            base = plain(tokens, positions, None)
            with adapters_off([adapted]):
                off = adapted(tokens, positions, None)
            on = adapted(tokens, positions, None)
    assert torch.equal(off, base)
    assert (on - base).abs().max() > 1e-2


def test_peft_adapters_are_read_and_checked_before_any_rank(tmp_path):
    """lora.from_peft: a PEFT adapter of the tiny model's shapes gives its rank, alpha and
    projections; another model's, a directory that is no adapter, DoRA, an adapter saved
    against a changed base (PiSSA) and non-LoRA adapters are one-line errors."""
    import json

    import peft
    import transformers

    from megarlhf.convert.peft_adapter import check_adapter
    from megarlhf.models.peft_format import CONFIG_FILE

    def saved(name, hidden, **lora):
        config = transformers.LlamaConfig(
            vocab_size=300, hidden_size=hidden, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2)
        model = peft.get_peft_model(transformers.LlamaForCausalLM(config),
                                    peft.LoraConfig(task_type="CAUSAL_LM", **lora))
        model.save_pretrained(tmp_path / name)
        return str(tmp_path / name)

    tiny = preset("tiny")
    good = saved("good", 64, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                 lora_dropout=0.05)
    lora = LoraConfig(from_peft=good)
    assert (lora.rank, lora.alpha, lora.dropout, lora.targets) == (4, 8.0, 0.05,
                                                                  ("q_proj", "v_proj"))
    check_adapter(good, tiny, lora)
    other = saved("other", 32, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    with pytest.raises(ValueError, match="this base needs .* trained on another model"):
        check_adapter(other, tiny, LoraConfig(from_peft=other))
    with pytest.raises(ValueError, match="is not a PEFT adapter directory"):
        LoraConfig(from_peft=str(tmp_path))
    dora = saved("dora", 64, r=4, target_modules=["q_proj"], use_dora=True)
    with pytest.raises(ValueError, match="'use_dora': True"):
        LoraConfig(from_peft=dora)
    with open(tmp_path / "good" / CONFIG_FILE) as f:
        original = json.load(f)
    for change, message in (({"peft_type": "IA3"}, "only LORA adapters load"),
                             ({"init_lora_weights": "pissa"}, "'init_lora_weights': 'pissa'")):
        with open(tmp_path / "good" / CONFIG_FILE, "w") as f:
            json.dump({**original, **change}, f)
        with pytest.raises(ValueError, match=message):
            LoraConfig(from_peft=good)


def test_dropout_draws_one_mask_per_projection_in_training_only():
    """lora.dropout: in training, each projection's adapter sees its own mask of the input:
    element (t, b, f) kept when the hash of its index (t * B + b) * F + f with the
    projection's seed (the forward's, times 7, plus the projection's number) is >= p; in
    eval, no mask. The hash is uniform (1e6 draws: mean and a decile within 3e-3)."""
    from megarlhf.models.lora import TARGETS, _hash_uniform

    u = _hash_uniform(torch.arange(1_000_000), 12345)
    assert abs(u.mean() - 0.5) < 3e-3 and abs((u < 0.1).double().mean() - 0.1) < 3e-3
    model = preset("tiny")
    p = 0.3
    lora = LoraConfig(rank=3, dropout=p, init="gaussian")
    with fake_rank(ParallelConfig(), 0) as mesh:
        chunk = build_model(model_spec(model, ParallelConfig(), lora=lora, on_gpu=False),
                            mesh)[0]
        linear = chunk.decoder.layers[0].self_attention.linear_qkv
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for b in linear.lora_B.values():
                b.normal_(generator=generator)
        s, b, f = 5, 2, model.hidden_size
        x = torch.randn(s, b, f, generator=generator)
        q_rows, _ = _fuse_qkv(model)
        adapters = [(linear.lora_A[n].detach(), linear.lora_B[n].detach())
                    for n in ("q_proj", "k_proj", "v_proj")]
        with torch.no_grad():
            linear.eval()
            plain = linear(x)[0]
            # fp32: the fused layer and the reference add the same products in other orders
            torch.testing.assert_close(plain, _reference(x, linear.weight, adapters,
                                                         lora.scale, q_rows),
                                       atol=1e-5, rtol=1e-5)
            linear.train()
            linear._call_seed = lambda: 1234  # the forward's seed; each projection's follows
            dropped = linear(x)[0]
            seeds = [1234 * len(TARGETS) + TARGETS.index(n) for n in ("q_proj", "k_proj",
                                                                      "v_proj")]
        index = torch.arange(s * b * f).view(s, b, f)  # (t * B + b) * F + f
        masks = [(_hash_uniform(index, seed) >= p).float() / (1 - p) for seed in seeds]
        deltas = [lora.scale * ((x * m) @ a.t() @ b.t()).reshape(-1, b.shape[0])
                  for m, (a, b) in zip(masks, adapters)]
        fused = torch.cat(q_rows([d.t() for d in deltas]), dim=0).t().reshape(s, b, -1)
        torch.testing.assert_close(dropped, x @ linear.weight.t() + fused, atol=1e-5, rtol=1e-5)
        assert (dropped - plain).abs().max() > 1e-2
        assert not torch.equal(masks[0], masks[1])


def test_recomputation_replays_the_dropout_masks():
    """Under megatron-core's full recomputation a layer runs twice per micro-batch (without
    gradients, then again in the backward pass): the replay must see the first pass's masks.
    Two micro-batches through a checkpointed adapted layer give the gradients of the same
    micro-batches without recomputation, exactly."""
    model = preset("tiny")
    lora = LoraConfig(rank=3, dropout=0.3, init="gaussian")
    with fake_rank(ParallelConfig(), 0) as mesh:
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        chunk = build_model(model_spec(model, ParallelConfig(), lora=lora, on_gpu=False),
                            mesh)[0].train()
        linear = chunk.decoder.layers[2].mlp.linear_fc1
        with torch.no_grad():
            for b in linear.lora_B.values():
                b.normal_()
        inputs = [torch.randn(4, 1, model.hidden_size, requires_grad=True) for _ in range(2)]

        def grads(checkpointed: bool) -> list[torch.Tensor]:
            linear.start_dropout_step(11)
            for p in linear.parameters():
                p.grad = None
            outs = [tensor_parallel.checkpoint(lambda x: linear(x)[0], False, x)
                    if checkpointed else linear(x)[0] for x in inputs]
            for out in outs:  # backwards in forward order, as 1F1B runs them
                out.square().sum().backward()
            return [p.grad.clone() for p in linear.lora_B.values()]

        plain, replayed = grads(False), grads(True)
    assert all(torch.equal(a, b) for a, b in zip(plain, replayed))
    assert not linear.lora_replays  # every queued seed was taken


def _data_bytes(path) -> int:
    """The bytes of a checkpoint's tensor data files."""
    return sum(f.stat().st_size for f in path.glob("*.distcp"))


@pytest.mark.slow
def test_an_adapter_only_checkpoint_resumes_at_another_layout_over_a_moved_base(
        lm_ref, tiny, tmp_path):
    """A LoRA engine saves its adapters and their Adam states, no base weight: the tensor
    data it saves less than a checkpoint with every weight is exactly the base checkpoint's.
    Resumed at TP2 over the base moved elsewhere, the next step's loss and gradient norm
    equal the unbroken TP1 run's (1e-5 relative: TP2 changes fp32 summation order only); a
    changed base is refused in one line naming both paths. The merged export and a judge's
    streamed tensors equal those of the full checkpoint bit for bit."""
    import glob
    import shutil

    from safetensors.torch import load_file

    from megarlhf.convert.mcore_io import CheckpointReader
    from megarlhf.convert.mcore_to_hf import checkpoint_hf_tensors, mcore_to_hf
    from megarlhf.engine.checkpoint import check_resumed_adapters
    from megarlhf.models.lora import is_adapter_key
    from megarlhf.parallel import launch_local
    from megarlhf.plan.params import saved_bytes
    from megarlhf.ppo.judge import judge_model
    from tests import workers

    lora = LoraConfig(rank=4, alpha=8.0, init="gaussian", seed=3)
    batches = [workers.make_batch(tiny, batch=4, seq=16, seed=s) for s in range(3)]
    base = tmp_path / "base"
    shutil.copytree(lm_ref, base)
    adapters, full = tmp_path / "adapters", tmp_path / "full"
    unbroken = launch_local(workers.lora_steps, 1, str(base), tiny, ParallelConfig(), batches,
                            lora=lora)[0]
    launch_local(workers.lora_steps, 1, str(base), tiny, ParallelConfig(), batches[:2],
                 lora=lora, save_to=str(adapters), save_full_to=str(full))

    stored = CheckpointReader(str(adapters)).metadata.state_dict_metadata
    tensors = [k for k in stored if not k.startswith("optimizer.")]
    assert tensors and all(is_adapter_key(k) for k in tensors), tensors
    assert any(k.startswith("optimizer.") and is_adapter_key(k) for k in stored)
    assert _data_bytes(full) - _data_bytes(adapters) == _data_bytes(base)
    # `megarlhf plan`'s bytes per save (adapters, their fp32 copy and Adam moments) are the
    # tensors the checkpoint lists (its files add DCP's headers, ~3 KB a tensor).
    listed = sum(math.prod(m.size) * m.properties.dtype.itemsize for m in stored.values()
                 if hasattr(m, "size"))
    assert listed == saved_bytes(tiny, value_head=False, lora=lora, param_bytes=4)

    # Its base in place: a judge takes it (its base's tensors found; the tokenizer sidecar
    # the judge also needs stands empty here), and streams the full checkpoint's tensors.
    (adapters / "hf").mkdir()
    assert judge_model(str(adapters)).checkpoint
    ours, theirs = dict(checkpoint_hf_tensors(str(adapters))), dict(checkpoint_hf_tensors(
        str(full)))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)

    moved = tmp_path / "moved"
    base.rename(moved)
    with pytest.raises(ValueError, match=r"holds LoRA adapters trained over the base .*/base "
                                         r"\(weights [0-9a-f]{12}\), but .*/base is no complete "
                                         r"checkpoint: restore that base, or give where it "
                                         r"moved with --base"):
        mcore_to_hf(str(adapters), str(tmp_path / "hf"))
    exported = mcore_to_hf(str(adapters), str(tmp_path / "hf"), base=str(moved))
    reference = mcore_to_hf(str(full), str(tmp_path / "hf_full"))
    ours, theirs = ({k: v for f in glob.glob(f"{d}/*.safetensors") for k, v in load_file(f).items()}
                    for d in (exported, reference))
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)

    resumed = launch_local(workers.lora_steps, 2, str(moved), tiny,
                           ParallelConfig(tensor_parallel=2), batches[2:], lora=lora,
                           resume_from=str(adapters), moved_base=str(moved))
    for curve in resumed:
        assert curve[0] == pytest.approx(unbroken[2], rel=1e-5), (curve, unbroken)

    other = tmp_path / "other"
    launch_local(workers.write_reference, 1, str(other), tiny, 1)
    with pytest.raises(ValueError, match=r"but .*/base is no complete checkpoint; .*/other "
                                         r"holds other weights: restore that base, or give "
                                         r"where it moved with actor$"):
        check_resumed_adapters(str(adapters), lora, "layout.actor.lora", base=str(other),
                               base_field="actor")
    # With the base back in place, a recipe naming another model cannot swap it in.
    moved.rename(base)
    with pytest.raises(ValueError, match=r"its adapters trained over .*/base, actor now gives "
                                         r".*/other, other weights; adapters keep their base"):
        check_resumed_adapters(str(adapters), lora, "layout.actor.lora", base=str(other),
                               base_field="actor")
