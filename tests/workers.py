"""Per-rank functions for multi-process tests (importable, so `spawn` can run them).

Every parallel result is compared with the TP1/PP1/DP1 result of the same weights and data:
weights come from one reference checkpoint written by a single rank, data from a seeded
generator, so each layout starts from identical numbers.
"""

from __future__ import annotations

import torch

from megarlhf.convert.verify import checkpoint_outputs
from megarlhf.engine.checkpoint import load_checkpoint, save_checkpoint
from megarlhf.engine.losses import lm_loss
from megarlhf.engine.optim import OptimConfig
from megarlhf.engine.schedule import rank_microbatches
from megarlhf.engine.train import TrainEngine
from megarlhf.models.config import ModelConfig
from megarlhf.models.gpt import ModelSpec, model_spec
from megarlhf.parallel.mesh import ParallelConfig, init_mesh

OPTIM = OptimConfig(lr=1e-2, weight_decay=0.01, clip_grad=1.0, warmup_steps=1, decay_steps=10)


def make_spec(model: ModelConfig, parallel: ParallelConfig, *, value_head=False,
              layer_spec="local") -> ModelSpec:
    return model_spec(model, parallel, value_head=value_head, layer_spec=layer_spec,
                      on_gpu=False)


def make_batch(model: ModelConfig, *, batch: int, seq: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.vocab_size, (batch, seq + 1), generator=g)
    loss_mask = torch.ones(batch, seq)
    loss_mask[0, : seq // 2] = 0  # uneven token counts per sequence
    return {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "loss_mask": loss_mask,
        "position_ids": torch.arange(seq).expand(batch, seq).contiguous(),
    }


def write_reference(path: str, model: ModelConfig, seed: int, value_head: bool = False):
    """Single rank: build TP1/PP1 weights from `seed` and save them (model only)."""
    parallel = ParallelConfig()
    mesh = init_mesh(parallel, seed=seed)
    engine = TrainEngine(make_spec(model, parallel, value_head=value_head), mesh)
    save_checkpoint(path, engine, mesh, with_optimizer=False)


def forward_outputs(ckpt: str, parallel: ParallelConfig, batch: dict, *,
                    microbatches: int = 1, layer_spec: str = "local"):
    """Full-vocab logits (or values) [B, T, ...] of a checkpoint for the global batch."""
    return checkpoint_outputs(ckpt, parallel, batch["tokens"], microbatches=microbatches,
                              layer_spec=layer_spec)


def in_sequence(calls: list[tuple]) -> list:
    """Several per-rank functions [(fn, args, kwargs)], one after the other in one set of
    ranks (each builds its own mesh), as separate launches would run them; their results."""
    return [fn(*args, **kwargs) for fn, args, kwargs in calls]


def train_curve(ckpt: str, model: ModelConfig, parallel: ParallelConfig, batches: list[dict],
                *, microbatches: int = 1, optim: OptimConfig = OPTIM,
                save_to: str | None = None, save_after: int | None = None,
                resume_from: str | None = None):
    """(loss, grad_norm) per step training on `batches` from the reference weights."""
    mesh = init_mesh(parallel)
    engine = TrainEngine(make_spec(model, parallel), mesh, optim)
    if resume_from:
        load_checkpoint(resume_from, engine, with_optimizer=True)
    else:
        load_checkpoint(ckpt, engine, with_optimizer=False)
    curve = []
    for step, batch in enumerate(batches):
        m = engine.train_step(rank_microbatches(batch, mesh, microbatches), lm_loss(mesh, model.vocab_size))
        curve.append((m.loss, m.num_tokens, m.grad_norm, m.lr, m.skipped))
        if save_to and step + 1 == save_after:
            save_checkpoint(save_to, engine, mesh)
    return curve


def assert_same_curves(per_rank: list, ref_curve: list) -> None:
    """Every rank's train_curve equals the reference: token counts, lr and skips exactly,
    losses and grad norms at rel 1e-5 (fp32 summation order)."""
    import pytest

    for rank, curve in enumerate(per_rank):
        for step, (a, b) in enumerate(zip(curve, ref_curve)):
            loss_a, tokens_a, gnorm_a, lr_a, skipped_a = a
            loss_b, tokens_b, gnorm_b, lr_b, skipped_b = b
            assert (tokens_a, lr_a, skipped_a) == (tokens_b, lr_b, skipped_b)
            assert loss_a == pytest.approx(loss_b, rel=1e-5), f"rank {rank} step {step} loss"
            assert gnorm_a == pytest.approx(gnorm_b, rel=1e-5), f"rank {rank} step {step} gnorm"


def traced_sites_of_a_step(model: ModelConfig) -> list[str]:
    """One train step + checkpoint save at TP1 with the compat trace on; the redirected sites."""
    import tempfile

    from megarlhf.compat.megatron import apply_cpu_compat, traced_sites

    apply_cpu_compat(trace=True)
    parallel = ParallelConfig()
    mesh = init_mesh(parallel)
    engine = TrainEngine(make_spec(model, parallel), mesh, OPTIM)
    engine.train_step([make_batch(model, batch=2, seq=8, seed=0)], lm_loss(mesh, model.vocab_size))
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(f"{tmp}/ckpt", engine, mesh)
    return traced_sites()


def outputs_of_checkpoints(ckpts: list[str], parallel: ParallelConfig,
                           tokens: list[torch.Tensor]) -> list[torch.Tensor]:
    """Logits (or values) of several checkpoints at one layout, in one set of ranks."""
    return [checkpoint_outputs(c, parallel, t, layer_spec="local") for c, t in zip(ckpts, tokens)]


def resave_for_training(ckpt: str, out: str, parallel: ParallelConfig) -> None:
    """Load a checkpoint into a trainable engine at `parallel` and save it from there."""
    from megarlhf.engine.checkpoint import read_meta

    meta = read_meta(ckpt)
    mesh = init_mesh(parallel)
    engine = TrainEngine(make_spec(ModelConfig.from_dict(meta["model"]), parallel,
                                   value_head=meta["value_head"]), mesh, OPTIM)
    load_checkpoint(ckpt, engine, with_optimizer=False)
    save_checkpoint(out, engine, mesh)


def weight_change_of_a_16_bit_step(ckpt: str, dtype: str, distributed: bool) -> float:
    """The share of weight elements the first 16-bit update at lr 1e-9 changes after a
    model-only load of `ckpt` (a fresh optimizer). The step moves a weight by a representable
    amount only where its fp32 master lies within ~1e-9 of a 16-bit rounding midpoint, so
    almost every weight stays the loaded one, unless the optimizer's fp32 master weights are
    stale (the random init the engine was built with): then the step writes those back."""
    from megarlhf.engine.checkpoint import engine_from_checkpoint, read_meta
    from megarlhf.models.transformer_config import parse_dtype

    parallel = ParallelConfig()
    mesh = init_mesh(parallel)
    engine = engine_from_checkpoint(ckpt, parallel, mesh,
                                    OptimConfig(lr=1e-9, use_distributed_optimizer=distributed),
                                    dtype=parse_dtype(dtype), on_gpu=False)
    params = [p for chunk in engine.unwrapped() for p in chunk.parameters()]
    before = [p.detach().float().clone() for p in params]
    model = ModelConfig.from_dict(read_meta(ckpt)["model"])
    batch = make_batch(model, batch=2, seq=8, seed=0)
    for _ in range(8):  # fp16: until the dynamic loss scale stops skipping the update
        if not engine.train_step([batch], lm_loss(mesh, model.vocab_size)).skipped:
            changed = sum(int((p.detach().float() != b).sum()) for p, b in zip(params, before))
            return changed / sum(b.numel() for b in before)
    raise AssertionError("every step was skipped")


def sixteen_bit_masters(ckpt: str, dtype: str, stage: str) -> tuple[dict, dict]:
    """After a model-only load of `ckpt` into a 16-bit engine with the distributed optimizer
    (one rank: each master shard is its whole weight), as the PPO roles ("ppo":
    engine_from_checkpoint) or SFT ("sft": its init_weights) load it: parameter name -> its
    fp32 master, and name -> the weight an fp32 engine loads from `ckpt`."""
    from megarlhf.engine.checkpoint import engine_from_checkpoint, read_meta
    from megarlhf.models.transformer_config import parse_dtype
    from megarlhf.sft.config import ModelSource
    from megarlhf.sft.model import init_weights, new_engine

    parallel = ParallelConfig()
    mesh = init_mesh(parallel)
    fp32 = engine_from_checkpoint(ckpt, parallel, mesh, None, on_gpu=False)
    loaded = {n: p.detach().clone() for chunk in fp32.chunks for n, p in chunk.named_parameters()}
    if stage == "ppo":
        engine = engine_from_checkpoint(ckpt, parallel, mesh, OptimConfig(),
                                        dtype=parse_dtype(dtype), on_gpu=False)
    else:
        source = ModelSource(checkpoint=ckpt, dtype=dtype)
        engine = new_engine(source, ModelConfig.from_dict(read_meta(ckpt)["model"]), parallel,
                            mesh, OptimConfig(), value_head=False)
        init_weights(source, engine)
    names = {p: n.removeprefix("module.") for chunk in engine.chunks
             for n, p in chunk.named_parameters()}
    masters = {}
    for opt in getattr(engine.optimizer, "chained_optimizers", [engine.optimizer]):
        for params, shards in zip(opt.model_float16_groups, opt.shard_fp32_from_float16_groups):
            for param, shard in zip(params, shards):
                assert shard.numel() == param.numel()  # one rank: the whole weight
                masters[names[param]] = shard.detach().view(param.shape).clone()
    return masters, loaded


def check_fp32_masters(masters: dict, stored: dict, off_grid_share: float) -> None:
    """sixteen_bit_masters' results: every master is the fp32 weight, bitwise, and more than
    `off_grid_share` of their elements lie off bf16's grid (so the check tells them from
    rounded copies)."""
    assert masters and set(masters) == set(stored), set(masters) ^ set(stored)
    off_grid = 0
    for name, master in masters.items():
        assert master.dtype == torch.float32 and torch.equal(master, stored[name]), name
        off_grid += int((master.bfloat16().float() != master).sum())
    assert off_grid > off_grid_share * sum(m.numel() for m in masters.values())


def offload_round_trip(ckpt: str, model: ModelConfig, parallel: ParallelConfig,
                       dtype_name: str) -> dict:
    """One train step (so Adam's state exists), then every kind offloaded and reloaded:
    what each kind's storages hold while offloaded, and whether every tensor came back."""
    from megarlhf.engine.offload import KINDS, Offloader
    from megarlhf.models.transformer_config import parse_dtype

    mesh = init_mesh(parallel)
    spec = model_spec(model, parallel, layer_spec="local", on_gpu=False,
                      dtype=parse_dtype(dtype_name))
    engine = TrainEngine(spec, mesh, OPTIM)
    load_checkpoint(ckpt, engine, with_optimizer=False)
    batch = make_batch(model, batch=2 * mesh.dp_size, seq=8, seed=1)
    engine.train_step(rank_microbatches(batch, mesh, 1), lm_loss(mesh, model.vocab_size))
    offloader = Offloader(engine)
    tensors = {kind: offloader.tensors(kind) for kind in KINDS}
    before = {kind: [t.detach().clone() for t in ts] for kind, ts in tensors.items()}
    offloader.offload(KINDS)
    out = {
        "counts": {kind: len(ts) for kind, ts in tensors.items()},
        "offloaded_bytes": {kind: sum(t.untyped_storage().nbytes() for t in ts)
                            for kind, ts in tensors.items()},
        "host_bytes": {kind: sum(h.numel() for _, _, h in offloader._host[kind]
                                 if h is not None) for kind in KINDS},
        "storage_bytes": {kind: sum(n for _, n, _ in offloader._host[kind]) for kind in KINDS},
    }
    # Held here, so no new buffer can take a freed one's id.
    hosts = [h for kind in KINDS for _, _, h in offloader._host[kind] if h is not None]
    offloader.reload(KINDS)
    out["bitwise"] = {kind: all(torch.equal(t, b) for t, b in zip(tensors[kind], before[kind]))
                      for kind in ("params", "optimizer")}
    out["grads_zero"] = all(not t.any() for t in tensors["grads"])
    # The engine trains on after the round trip (every view still points at live memory).
    m = engine.train_step(rank_microbatches(batch, mesh, 1), lm_loss(mesh, model.vocab_size))
    out["step_after"] = (m.loss, m.grad_norm)
    # A second round trip copies into the first one's host buffers (no new pinned memory).
    trained = {kind: [t.detach().clone() for t in ts] for kind, ts in tensors.items()}
    offloader.offload(KINDS)
    out["buffers_reused"] = {id(h) for kind in KINDS for _, _, h in offloader._host[kind]
                             if h is not None} == set(map(id, hosts))
    offloader.reload(KINDS)
    out["bitwise_again"] = all(torch.equal(t, b) for kind in ("params", "optimizer")
                               for t, b in zip(tensors[kind], trained[kind]))
    return out


def lora_steps(base: str, model: ModelConfig, parallel: ParallelConfig, batches: list[dict], *,
               lora, resume_from: str | None = None, moved_base: str | None = None,
               save_to: str | None = None, save_full_to: str | None = None):
    """(loss, grad_norm) per step training LoRA adapters `lora` over the checkpoint `base`
    (or resumed from the adapter-only `resume_from`, its base moved to `moved_base`); after
    the last step, saved to `save_to`, and with every weight (the checkpoint LoRA runs wrote
    before adapter-only ones) to `save_full_to`."""
    mesh = init_mesh(parallel)
    engine = TrainEngine(model_spec(model, parallel, layer_spec="local", on_gpu=False,
                                    lora=lora), mesh, OPTIM)
    if resume_from:
        load_checkpoint(resume_from, engine, with_optimizer=True, base=moved_base)
    else:
        load_checkpoint(base, engine, with_optimizer=False)
    curve = []
    for batch in batches:
        m = engine.train_step(rank_microbatches(batch, mesh, 1), lm_loss(mesh, model.vocab_size))
        curve.append((m.loss, m.grad_norm))
    if save_to:
        save_checkpoint(save_to, engine, mesh)
    if save_full_to:
        engine.provenance = {**engine.provenance, "base": None}
        save_checkpoint(save_full_to, engine, mesh)
    return curve
