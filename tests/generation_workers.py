"""Per-rank functions for the Megatron rollout engine tests (importable, so `spawn` can run
them), and the HF-named weight streams they load.

References are computed the slow, obvious way: one prompt at a time, no padding, no KV cache,
a full forward over the whole sequence for every new token.
"""

from __future__ import annotations

import dataclasses

import torch

from megarlhf.models.arch import architecture_for_model
from megarlhf.models.config import ModelConfig
from megarlhf.models.gpt import build_model, model_spec
from megarlhf.parallel.mesh import ParallelConfig, init_mesh
from megarlhf.rollout.engine import SamplingParams
from megarlhf.rollout.megatron_engine import MegatronEngine, MegatronEngineConfig
from megarlhf.rollout.pieces import local_pieces

GREEDY = SamplingParams(max_new_tokens=10, temperature=0)
SAMPLED = SamplingParams(max_new_tokens=10, temperature=0.9, top_k=40, top_p=0.9,
                         repetition_penalty=1.2, n=3, seed=1)


def random_hf_weights(model: ModelConfig, seed: int) -> list[tuple[str, torch.Tensor]]:
    """Every HF tensor of the LM, random. Wider than the init (std 0.15, norms 1 +- 0.1) so
    that next-token distributions are peaked and greedy choices are far from ties."""
    g = torch.Generator().manual_seed(seed)
    weights = []
    for rule in architecture_for_model(model).rules(model, lm_head=True, value_head=False):
        for index in rule.indices(model):
            for name, shape in zip(rule.hf_names(index), rule.hf_shapes):
                noise = torch.randn(shape, generator=g)
                weights.append((name, 1 + 0.1 * noise if len(shape) == 1 else 0.15 * noise))
    return weights


def model_hf_weights(chunk: torch.nn.Module, model: ModelConfig) -> list[tuple[str, torch.Tensor]]:
    """The HF tensors of a TP1 model chunk, each full tensor assembled from its pieces (at
    TP1 only the fused gate/up MLP weight comes in more than one)."""
    full = {}
    for piece in local_pieces([chunk]):
        target = full.setdefault(piece.unit, piece.data.new_zeros(piece.full_shape))
        piece.region(target).copy_(piece.data)
    weights = []
    for rule in architecture_for_model(model).rules(model, lm_head=True, value_head=False):
        for index in rule.indices(model):
            tensors = rule.split(full[rule.mcore, index])
            if rule.vocab:
                tensors = [t[: model.vocab_size] for t in tensors]
            weights += [(n, t.clone()) for n, t in zip(rule.hf_names(index), tensors)]
    return weights


def buckets(weights: list, size: int) -> list[list]:
    return [weights[i:i + size] for i in range(0, len(weights), size)]


@torch.no_grad()
def full_forward_logits(chunk, tokens: list[int], vocab_size: int) -> torch.Tensor:
    """Logits [len(tokens), V] of one unpadded sequence, plain forward (TP1)."""
    x = torch.tensor([tokens])
    return chunk(x, torch.arange(len(tokens))[None], None)[0, :, :vocab_size].float()


def reference_greedy(chunk, prompt: list[int], steps: int,
                     vocab_size: int) -> tuple[list[int], list[float]]:
    """Step-by-step argmax, one full forward over the whole sequence per new token."""
    tokens, logprobs = list(prompt), []
    for _ in range(steps):
        z = full_forward_logits(chunk, tokens, vocab_size)[-1]
        token = int(z.argmax())
        logprobs.append(float(torch.log_softmax(z, -1)[token]))
        tokens.append(token)
    return tokens[len(prompt):], logprobs


def teacher_forced(chunk, prompt: list[int], completion: list[int], vocab_size: int,
                   penalty: float = 1.0) -> tuple[list[int], list[float]]:
    """One full forward over prompt + completion: at each completion step, the greedy choice
    under the repetition penalty (applied by hand, HF rule, over the ids before that step) and
    log_softmax of the raw logits at the completion's token."""
    logits = full_forward_logits(chunk, prompt + completion, vocab_size)[len(prompt) - 1:-1]
    choices = []
    for step, z in enumerate(logits):
        seen = torch.zeros(vocab_size, dtype=torch.bool)
        seen[prompt + completion[:step]] = True
        choices.append(int(torch.where(seen, torch.where(z > 0, z / penalty, z * penalty), z)
                           .argmax()))
    logp = torch.log_softmax(logits, dim=-1)
    return choices, logp[torch.arange(len(completion)), torch.tensor(completion)].tolist()


def error_of(fn) -> tuple[str, str]:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the test inspects the type and message
        return type(e).__name__, str(e)
    return "none", ""


def as_tuples(completions) -> list[tuple]:
    return [(c.prompt_index, c.token_ids, c.logprobs, c.finish_reason) for c in completions]


def _engine(model: ModelConfig, parallel: ParallelConfig, **config):
    mesh = init_mesh(parallel)
    spec = model_spec(model, parallel, layer_spec="local", on_gpu=False)
    return MegatronEngine(spec, mesh, MegatronEngineConfig(**config)), spec, mesh


def tp1_checks(model: ModelConfig, prompts: list[list[int]]) -> dict:
    """Single rank: everything the fast tier checks, returned as plain data."""
    engine, spec, mesh = _engine(model, ParallelConfig(), max_batch_size=8)
    V = model.vocab_size
    weights = random_hf_weights(model, seed=0)
    out = {"before_weights": error_of(lambda: engine.generate(prompts, GREEDY))}
    engine.update_weights(buckets(weights, 3))

    greedy = engine.generate(prompts, GREEDY)
    penalized = dataclasses.replace(GREEDY, repetition_penalty=1.5)
    out["greedy"] = as_tuples(greedy)
    out["greedy_ref"] = [reference_greedy(engine.model, p, 10, V) for p in prompts]
    out["penalized"] = as_tuples(engine.generate(prompts, penalized))
    out["penalized_ref"] = [teacher_forced(engine.model, p, c[1], V, 1.5)
                            for p, c in zip(prompts, out["penalized"])]

    sampled = [engine.generate(prompts, dataclasses.replace(SAMPLED, seed=s)) for s in (1, 1, 2)]
    out["sampled"] = [as_tuples(s) for s in sampled]
    out["sampled_ref_logprobs"] = [
        teacher_forced(engine.model, prompts[c.prompt_index], c.token_ids, V)[1]
        for c in sampled[0]]
    out["top_k1"] = as_tuples(engine.generate(
        prompts, SamplingParams(max_new_tokens=10, temperature=0.7, top_k=1, seed=3)))

    candidates = (7, 250, 3, V - 1)
    first = engine.generate(prompts, dataclasses.replace(SAMPLED, seed=4,
                                                         first_token_candidates=candidates))
    out["first"] = [(c.prompt_index, c.first_logprobs) for c in first]
    out["first_ref"] = [torch.log_softmax(full_forward_logits(engine.model, p, V)[-1], -1)[
        list(candidates)].tolist() for p in prompts]
    out["first_out_of_vocab"] = error_of(lambda: engine.generate(
        prompts, dataclasses.replace(GREEDY, first_token_candidates=(V,))))

    stop = greedy[0].token_ids[2]
    out["stop_token"] = stop
    out["greedy_stopped"] = as_tuples(engine.generate(
        prompts, dataclasses.replace(GREEDY, stop_token_ids=(stop,))))
    out["sampled_stopped"] = as_tuples(engine.generate(
        prompts, dataclasses.replace(SAMPLED, stop_token_ids=(stop, 7, 8, 9))))
    limits = tuple(1 + 3 * i for i in range(len(prompts)))  # each prompt its own budget
    out["limits"] = limits
    out["greedy_limited"] = as_tuples(engine.generate(
        prompts, dataclasses.replace(GREEDY, max_new_tokens_each=limits)))

    out.update(_vocab_padding_checks(engine, model))
    out.update(_weight_stream_checks(engine, spec, mesh, model, prompts))
    out.update(_lifecycle_checks(engine, weights, prompts, mesh, spec))
    return out


def _vocab_padding_checks(engine, model) -> dict:
    """Padding rows arrive as zeros, and ids >= vocab_size are never chosen even when their
    logits are the largest."""
    V = model.vocab_size
    rows = [engine.model.embedding.word_embeddings.weight[V:],
            engine.model.output_layer.weight[V:]]
    logits = torch.randn(4, engine.model.output_layer.weight.shape[0])
    logits[:, V:] = 1e4
    g = torch.Generator().manual_seed(0)
    return {
        "padding_rows_max": max(float(r.abs().max()) for r in rows),
        "padding_rows": sum(r.shape[0] for r in rows),
        "chosen_with_hot_padding": [engine._choose(logits, None, params, g)[0].tolist()
                                    for params in (GREEDY, SAMPLED)],
    }


def _weight_stream_checks(engine, spec, mesh, model, prompts) -> dict:
    """A stream exported from another model (reversed, in buckets of 5, so a fused rule's
    tensors straddle buckets) must make the engine that model; bad streams must be named."""
    torch.manual_seed(5)
    other = build_model(spec, mesh)[0].eval()
    streamed = model_hf_weights(other, model)
    engine.update_weights(buckets(streamed[::-1], 5))
    probe = prompts[1] + prompts[0]
    out = {
        "stream_logits_diff": float((full_forward_logits(engine.model, probe, model.vocab_size)
                                     - full_forward_logits(other, probe, model.vocab_size))
                                    .abs().max()),
        "stream_greedy": [c.token_ids for c in engine.generate(prompts, GREEDY)],
    }
    out["stream_greedy_ref"] = [teacher_forced(other, p, tokens, model.vocab_size)[0]
                                for p, tokens in zip(prompts, out["stream_greedy"])]
    name, tensor = streamed[5]
    out["unknown"] = error_of(lambda: engine.update_weights([streamed + [("lm_head.bias",
                                                                       tensor)]]))
    out["misshapen"] = error_of(lambda: engine.update_weights(
        [streamed[:5] + [(name, tensor[:-1])] + streamed[6:]]))
    out["missing"] = error_of(lambda: engine.update_weights([streamed[:5] + streamed[6:]]))
    out["missing_name"] = name
    out["twice"] = error_of(lambda: engine.update_weights([streamed, streamed[:1]]))
    out["after_failed_update"] = error_of(lambda: engine.generate(prompts, GREEDY))
    return out


def _lifecycle_checks(engine, weights, prompts, mesh, spec) -> dict:
    out = {}
    engine.sleep()
    out["asleep_bytes"] = sum(p.untyped_storage().nbytes() for p in engine.model.parameters())
    out["asleep_generate"] = error_of(lambda: engine.generate(prompts, GREEDY))
    out["asleep_update"] = error_of(lambda: engine.update_weights([weights]))
    engine.wake()
    out["woken_generate"] = error_of(lambda: engine.generate(prompts, GREEDY))
    engine.update_weights([weights])
    out["greedy_after_wake"] = as_tuples(engine.generate(prompts, GREEDY))
    # A judge's sleep keeps the weights in host memory (once): woken, it generates without an
    # update, twice over; an update after such a wake still replaces them.
    for cycle in (1, 2):
        engine.sleep(keep_weights=True)
        out[f"kept_asleep_bytes_{cycle}"] = sum(p.untyped_storage().nbytes()
                                                for p in engine.model.parameters())
        engine.wake()
        out[f"greedy_after_kept_wake_{cycle}"] = as_tuples(engine.generate(prompts, GREEDY))
    engine.update_weights([[(name, torch.zeros_like(tensor)) for name, tensor in weights]])
    engine.sleep(keep_weights=True)
    engine.wake()
    out["greedy_after_zero_update"] = as_tuples(engine.generate(prompts, GREEDY))
    engine.update_weights([weights])

    def broken_forward(*args, **kwargs):
        raise RuntimeError("simulated kernel failure")

    engine.model.forward = broken_forward
    out["failing_generate"] = error_of(lambda: engine.generate(prompts, GREEDY))
    out["too_long"] = error_of(lambda: engine.generate(
        prompts, SamplingParams(max_new_tokens=spec.model.max_position_embeddings)))
    out["bad_prompt"] = error_of(lambda: engine.generate([[1, 2], []], GREEDY))
    pp_mesh = dataclasses.replace(mesh, config=ParallelConfig(pipeline_parallel=2))
    out["pp2"] = error_of(lambda: MegatronEngine(spec, pp_mesh))
    return out


def generations(model: ModelConfig, parallel: ParallelConfig, prompts: list[list[int]],
                params: list[SamplingParams]) -> list[list[tuple]]:
    """Per rank: completions for each SamplingParams, weights from the seed-0 HF stream."""
    engine, _, _ = _engine(model, parallel)
    engine.update_weights(buckets(random_hf_weights(model, seed=0), 4))
    return [as_tuples(engine.generate(prompts, p)) for p in params]
