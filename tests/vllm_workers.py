"""Per-rank functions for the vLLM engine tests (importable, so `spawn` can run them).

Each rank trains (PolicyRole over a TrainEngine loaded from a converted checkpoint) and rolls
out with its own in-process vLLM engine, fed by the WeightBridge: the colocated setup of PPO.
Results come back as plain data; the test file does the comparing.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from megarlhf.convert.mcore_to_hf import mcore_to_hf
from megarlhf.engine.checkpoint import (checkpoint_architecture, engine_from_checkpoint, read_meta,
                                       save_checkpoint)
from megarlhf.engine.optim import OptimConfig
from megarlhf.models.config import ModelConfig
from megarlhf.models.gpt import model_spec
from megarlhf.models.lora import LoraConfig
from megarlhf.parallel.mesh import ParallelConfig, init_mesh
from megarlhf.roles.policy import PolicyRole
from megarlhf.rollout.bridge import WeightBridge
from megarlhf.rollout.engine import Completion, SamplingParams
from megarlhf.rollout.experience import rollout_batch
from megarlhf.rollout.gap import logprob_gap
from megarlhf.rollout.megatron_engine import MegatronEngine, MegatronEngineConfig
from megarlhf.rollout.vllm_engine import VLLMEngine, VLLMEngineConfig
from tests.generation_workers import as_tuples, error_of

GREEDY = SamplingParams(max_new_tokens=12, temperature=0)
SAMPLED = SamplingParams(max_new_tokens=12, temperature=0.9, top_k=40, top_p=0.9,
                         repetition_penalty=1.2, n=3, seed=1)
MAX_MODEL_LEN = 64
# A few layers' worth: the stream comes in many buckets and fused tensors straddle them.
BUCKET_BYTES = 512 * 1024
OPTIM = OptimConfig(lr=1e-2, weight_decay=0.0, clip_grad=1.0)
"""Large enough that one step changes greedy outputs (the test checks it did)."""


def _actor(ckpt: str, parallel: ParallelConfig, mesh=None, lora: LoraConfig | None = None):
    mesh = mesh or init_mesh(parallel)
    engine = engine_from_checkpoint(ckpt, parallel, mesh, OPTIM, on_gpu=False, lora=lora)
    bridge = WeightBridge(engine.chunks, mesh, engine.spec.model,
                          checkpoint_architecture(read_meta(ckpt)), bucket_bytes=BUCKET_BYTES,
                          lora=lora)
    return PolicyRole(engine), bridge, mesh


def _engine(model_dir: str, **config) -> VLLMEngine:
    return VLLMEngine(VLLMEngineConfig(model_dir=model_dir, max_model_len=MAX_MODEL_LEN,
                                       kv_cache_memory_bytes=16 * 1024**2, **config))


def _scored(actor: PolicyRole, prompts, completions) -> dict:
    """Engine and trainer logprobs of the same sequences, and their gap."""
    batch = rollout_batch(prompts, completions)
    trainer_logp = actor.logprobs(batch.sequences)
    mask = batch.sequences.response_mask
    return {"engine": batch.engine_logp, "trainer": trainer_logp, "mask": mask,
            "gap": logprob_gap(batch.engine_logp, trainer_logp, mask)}


def colocated(hf_dir: str, ckpt: str, out_dir: str, prompts: list[list[int]]) -> dict:
    """Single rank, TP1 trainer + TP1 engine: everything but the TP2 comparison."""
    actor, bridge, mesh = _actor(ckpt, ParallelConfig())
    engine = _engine(hf_dir)
    out = {"before_weights": error_of(lambda: engine.generate(prompts, GREEDY))}
    engine.update_weights(bridge.stream())

    greedy = engine.generate(prompts, GREEDY)
    out["greedy"] = as_tuples(greedy)
    out["greedy_scored"] = _scored(actor, prompts, greedy)
    sampled = [engine.generate(prompts, dataclasses.replace(SAMPLED, seed=s)) for s in (1, 1, 2)]
    out["sampled"] = [as_tuples(s) for s in sampled]
    out["sampled_scored"] = _scored(actor, prompts, sampled[0])
    out["greedy_n2"] = as_tuples(engine.generate(prompts, dataclasses.replace(GREEDY, n=2)))
    # More prompt tokens than vLLM schedules in a step (4096), sampled with a seed: prefilled in
    # chunks, a seeded request's generator would be rewound, which CPU generators refuse.
    many = [[5 + i % 200] * 50 for i in range(100)]
    limits = tuple(1 + i % 3 for i in range(100))  # and each prompt its own budget
    out["many_seeded"] = as_tuples(engine.generate(many, dataclasses.replace(
        SAMPLED, max_new_tokens=3, n=1, max_new_tokens_each=limits)))
    out["many_limits"] = limits
    # A judge's yes/no: each of n=3 sampled completions of a prompt reports the candidates'
    # raw log p at its first new token; the trainer's, of each candidate forced as that token.
    candidates = (5, 17, 250)
    first = engine.generate(prompts, dataclasses.replace(SAMPLED, seed=4,
                                                         first_token_candidates=candidates))
    out["first"] = [(c.prompt_index, c.first_logprobs) for c in first]
    forced = [Completion(prompt_index=i, token_ids=[c], logprobs=[0.0], finish_reason="length")
              for i in range(len(prompts)) for c in candidates]
    scored = _scored(actor, prompts, forced)  # one response token a row
    out["first_ref"] = scored["trainer"][scored["mask"].bool()].view(
        len(prompts), len(candidates)).tolist()
    out["first_out_of_vocab"] = error_of(lambda: engine.generate(
        prompts, dataclasses.replace(GREEDY, first_token_candidates=(100_000,))))
    stop = greedy[0].token_ids[3]
    out["stop_token"] = stop
    out["greedy_stopped"] = as_tuples(engine.generate(
        prompts, dataclasses.replace(GREEDY, stop_token_ids=(stop,))))

    out.update(_failures(engine, bridge, prompts))
    out.update(_sleep_wake(engine, bridge, prompts))

    # One actor step on the greedy rollouts, then a sync: the engine must follow.
    batch = rollout_batch(prompts, greedy).sequences
    advantages = torch.randn(batch.shape, generator=torch.Generator().manual_seed(0))
    actor.train_step(batch, out["greedy_scored"]["trainer"], advantages)
    out["stale_gap"] = logprob_gap(out["greedy_scored"]["engine"], actor.logprobs(batch),
                                   batch.response_mask)  # before the sync
    engine.update_weights(bridge.stream())
    trained = engine.generate(prompts, GREEDY)
    out["trained_greedy"] = as_tuples(trained)
    out["trained_scored"] = _scored(actor, prompts, trained)
    out["trained_sampled"] = as_tuples(engine.generate(prompts, SAMPLED))
    out.update(_lora_sync(engine, ckpt, mesh, prompts))

    save_checkpoint(f"{out_dir}/actor", actor.engine, mesh, with_optimizer=False)
    mcore_to_hf(f"{out_dir}/actor", f"{out_dir}/actor_hf")
    engine.shutdown()
    out["trainer_group_alive"] = _trainer_group_works()
    fresh = _engine(f"{out_dir}/actor_hf", load_format="auto")
    out["fresh_greedy"] = as_tuples(fresh.generate(prompts, GREEDY))
    out["fresh_sampled"] = as_tuples(fresh.generate(prompts, SAMPLED))
    out.update(_failing_forward(fresh, prompts))
    fresh.shutdown()
    out["after_shutdown"] = error_of(lambda: fresh.generate(prompts, GREEDY))
    return out


def _lora_sync(engine: VLLMEngine, ckpt: str, mesh, prompts) -> dict:
    """A LoRA actor over the same base (adapters on every projection) trains one step, so B
    is no longer zero, and syncs W + scale * B @ A: the engine scores as the trainer does.
    Before that sync the engine holds the base, which the step moved away from."""
    actor, bridge, _ = _actor(ckpt, ParallelConfig(), mesh,
                              LoraConfig(rank=4, alpha=8.0, target_modules="all-linear"))
    engine.update_weights(bridge.stream())
    greedy = engine.generate(prompts, GREEDY)
    before = _scored(actor, prompts, greedy)
    batch = rollout_batch(prompts, greedy).sequences
    advantages = torch.randn(batch.shape, generator=torch.Generator().manual_seed(1))
    actor.train_step(batch, before["trainer"], advantages)
    out = {"lora_stale_gap": logprob_gap(before["engine"], actor.logprobs(batch),
                                         batch.response_mask)}
    engine.update_weights(bridge.stream())
    out["lora_scored"] = _scored(actor, prompts, engine.generate(prompts, GREEDY))
    return out


def _break_forward(worker) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("simulated kernel failure")

    worker.model_runner.model.forward = broken


def _restore_forward(worker) -> None:
    del worker.model_runner.model.forward  # the class's forward again


def _failing_forward(engine: VLLMEngine, prompts) -> dict:
    """A failure in the middle of vLLM's generation loop surfaces as an EngineError, and the
    next call is not polluted by the failed call's requests."""
    engine._llm.collective_rpc(_break_forward)
    out = {"failing_generate": error_of(lambda: engine.generate(prompts, GREEDY))}
    engine._llm.collective_rpc(_restore_forward)
    out["greedy_after_failure"] = as_tuples(engine.generate(prompts, GREEDY))
    out["out_of_vocab"] = error_of(lambda: engine.generate([[5, 100_000]], GREEDY))
    return out


def _failures(engine: VLLMEngine, bridge: WeightBridge, prompts) -> dict:
    """Failures inside the engine are EngineErrors naming it; the engine recovers after them."""
    weights = [(name, tensor.clone()) for bucket in bridge.stream() for name, tensor in bucket]
    name, tensor = weights[3]
    misshapen = weights[:3] + [(name, tensor[:-1])] + weights[4:]
    out = {
        "too_long": error_of(lambda: engine.generate(
            [list(range(1, MAX_MODEL_LEN - GREEDY.max_new_tokens + 2))], GREEDY)),
        "misshapen": error_of(lambda: engine.update_weights([misshapen])),
        "misshapen_name": name,
    }
    out["after_failed_update"] = error_of(lambda: engine.generate(prompts, GREEDY))
    out["unknown"] = error_of(lambda: engine.update_weights([weights + [("lm_head.bias",
                                                                       tensor)]]))
    out["missing"] = error_of(lambda: engine.update_weights([weights[:3] + weights[4:]]))
    engine.update_weights([weights])
    out["greedy_after_recovery"] = as_tuples(engine.generate(prompts, GREEDY))
    return out


def _sleep_wake(engine: VLLMEngine, bridge: WeightBridge, prompts) -> dict:
    out = {"kv_bytes_awake": engine.kv_cache_bytes()}
    engine.sleep()
    out["kv_bytes_asleep"] = engine.kv_cache_bytes()
    out["asleep_generate"] = error_of(lambda: engine.generate(prompts, GREEDY))
    out["asleep_update"] = error_of(lambda: engine.update_weights(bridge.stream()))
    # In stages, as the weight sync wakes it: weights, the update, then the KV cache.
    engine.wake(("weights",))
    out["kv_bytes_weights_woken"] = engine.kv_cache_bytes()
    out["woken_generate"] = error_of(lambda: engine.generate(prompts, GREEDY))
    engine.update_weights(bridge.stream())
    out["updated_generate_without_kv"] = error_of(lambda: engine.generate(prompts, GREEDY))
    engine.wake(("kv_cache",))
    out["kv_bytes_woken"] = engine.kv_cache_bytes()
    out["greedy_after_wake"] = as_tuples(engine.generate(prompts, GREEDY))
    # The whole cycle again (a second wake reads freshly allocated cache memory).
    engine.sleep()
    engine.wake()
    engine.update_weights(bridge.stream())
    out["greedy_after_second_wake"] = as_tuples(engine.generate(prompts, GREEDY))
    # A judge's sleep keeps its weights: woken, it generates without an update.
    engine.sleep(keep_weights=True)
    out["kv_bytes_kept_asleep"] = engine.kv_cache_bytes()
    out["kept_asleep_generate"] = error_of(lambda: engine.generate(prompts, GREEDY))
    engine.wake()
    out["greedy_after_kept_wake"] = as_tuples(engine.generate(prompts, GREEDY))
    return out


def _shm_segments(ident: str) -> list[str]:
    import glob

    return sorted(glob.glob(f"/dev/shm/{ident}-*"))


def _trainer_group_works() -> bool:
    ones = torch.ones(1)
    dist.all_reduce(ones)
    return float(ones) == dist.get_world_size()


def tensor_parallel(hf_dir: str, ckpt: str, prompts: list[list[int]]) -> dict:
    """Two ranks, a TP2 trainer feeding through its bridge first one TP1 engine per rank, then
    one TP2 engine over both ranks."""
    actor, bridge, _ = _actor(ckpt, ParallelConfig(tensor_parallel=2))
    out = {}
    for tp in (1, 2):
        engine = _engine(hf_dir, tensor_parallel_size=tp)
        engine.update_weights(bridge.stream())
        greedy = engine.generate(prompts, GREEDY)
        out[f"vllm_tp{tp}"] = {"greedy": as_tuples(greedy),
                               "scored": _scored(actor, prompts, greedy),
                               "shm_ident": engine._shm_ident,
                               "shm_running": _shm_segments(engine._shm_ident)}
        engine.shutdown()
        dist.barrier()  # every rank of the engine has shut down
        out[f"vllm_tp{tp}"]["shm_after"] = _shm_segments(engine._shm_ident)
    out["trainer_group_alive"] = _trainer_group_works()
    return out


# --------------------------------------------------------------- the architecture x layout matrix


_VOCAB_TENSORS = {"model.embed_tokens.weight": "embed_tokens", "lm_head.weight": "lm_head"}


def _recording(stream, store: dict):
    """Pass a weight stream through, keeping a copy of the vocabulary tensors it carries."""
    for bucket in stream:
        for name, tensor in bucket:
            if name in _VOCAB_TENSORS:
                store[_VOCAB_TENSORS[name]] = tensor.detach().clone()
        yield bucket


def _megatron_embeddings(engine: MegatronEngine) -> dict:
    """This rank's vocabulary rows of a Megatron engine's embedding and output projection (it
    computes with its parameters as they are)."""
    model, vocab = engine.model, engine.spec.model.vocab_size
    embedding = model.embedding.word_embeddings.weight
    head = model.shared_embedding_or_output_weight() \
        if model.share_embeddings_and_output_weights else model.output_layer.weight
    start = engine.mesh.tp_rank * embedding.shape[0]
    rows = max(0, min(embedding.shape[0], vocab - start))
    return {"embed_tokens": embedding[:rows], "lm_head": head[:rows], "vocab_start": start}


def _embeddings_match(engine, streamed: dict) -> dict:
    """Whether this rank's engine computes with exactly the streamed embedding and output
    projection (the embedding again when tied); vLLM's read through its own GEMM."""
    seen = engine._llm.collective_rpc("effective_embeddings")[0] \
        if isinstance(engine, VLLMEngine) else _megatron_embeddings(engine)
    start = seen["vocab_start"]
    out = {}
    for key in ("embed_tokens", "lm_head"):
        full = streamed.get(key, streamed["embed_tokens"])
        rows = full[start:start + seen[key].shape[0]].to(seen[key].dtype)
        out[key] = bool(torch.equal(seen[key], rows))
    return out


def _nudge_output_copy(engine_) -> None:
    """Move one element of the last stage's copy of a tied embedding by one ulp."""
    module = engine_.unwrapped()[-1]
    if module.post_process:
        weight = module.shared_embedding_or_output_weight()
        with torch.no_grad():
            weight[0, 0] = torch.nextafter(weight[0, 0], weight[0, 0] + 1)


def logprob_matrix(cases: list[tuple[str, str, str, list[int]]], parallel: ParallelConfig,
                   prompts: list[list[int]], *, backend: str = "vllm",
                   probe_tied_drift: bool = False) -> dict:
    """For each (label, HF dir, checkpoint, engine TPs) and engine TP: a trainer at `parallel`
    feeds a fresh engine, takes one optimizer step on the engine's samples (so a stale copy of any
    tensor shows), syncs again, and scores the engine's new samples. `backend` 'megatron':
    the colocated Megatron engine, in the trainer's layout (engine TPs are ignored). Per case and engine TP:
    the gap, whether the engine's embedding and output projection equal the trainer's
    bitwise. `probe_tied_drift`: afterwards, one ulp of difference between the last case's
    two embedding copies (PP > 1) must stop its next optimizer step."""
    out = {}
    mesh = None
    for label, hf_dir, ckpt, engine_tps in cases:
        mesh = mesh or init_mesh(parallel)
        # megatron-core trains MoE layers at TP > 1 only with sequence parallelism (a flag
        # of the model, not of the mesh the Megatron engine shares).
        moe = ModelConfig.from_dict(read_meta(ckpt)["model"]).is_moe
        train = dataclasses.replace(parallel,
                                    sequence_parallel=moe and parallel.tensor_parallel > 1)
        engine_ = engine_from_checkpoint(ckpt, train, mesh, OPTIM, on_gpu=False)
        bridge = WeightBridge(engine_.chunks, mesh, engine_.spec.model,
                              checkpoint_architecture(read_meta(ckpt)),
                              bucket_bytes=BUCKET_BYTES)
        actor = PolicyRole(engine_)
        for tp in engine_tps if backend == "vllm" else [parallel.tensor_parallel]:
            engine = _engine(hf_dir, tensor_parallel_size=tp) if backend == "vllm" else \
                MegatronEngine(model_spec(engine_.spec.model, parallel), mesh,
                               MegatronEngineConfig(architecture=bridge._arch_name))
            engine.update_weights(bridge.stream())
            first = engine.generate(prompts, SAMPLED)
            batch = rollout_batch(prompts, first).sequences
            advantages = torch.randn(batch.shape, generator=torch.Generator().manual_seed(tp))
            step, _ = actor.train_step(batch, actor.logprobs(batch), advantages)
            synced = {}
            engine.update_weights(_recording(bridge.stream(), synced))
            sampled = engine.generate(prompts, dataclasses.replace(SAMPLED, seed=7))
            out[label, tp] = {"gap": _scored(actor, prompts, sampled)["gap"],
                              "embeddings": _embeddings_match(engine, synced),
                              "skipped": step.skipped}
            engine.shutdown()
    if probe_tied_drift:
        _nudge_output_copy(engine_)
        out["drift"] = error_of(lambda: actor.train_step(batch, actor.logprobs(batch),
                                                         advantages))
    return out


def greedy_from_files(model_dir: str, prompts: list[list[int]], max_new_tokens: int
                      ) -> list[list[int]]:
    """Greedy tokens of an engine that loads `model_dir`'s own weights, stopping at its EOS."""
    from megarlhf.data.tokenizer import eos_token_ids

    init_mesh(ParallelConfig())
    engine = VLLMEngine(VLLMEngineConfig(model_dir=model_dir, load_format="auto",
                                         max_model_len=max(map(len, prompts)) + max_new_tokens,
                                         kv_cache_memory_bytes=64 * 1024**2))
    params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0,
                            stop_token_ids=eos_token_ids(model_dir))
    tokens = [c.token_ids for c in engine.generate(prompts, params)]
    engine.shutdown()
    return tokens
