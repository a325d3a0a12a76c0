"""Where bf16 departs from fp32 on the arithmetic recipe (issue 65): SmolLM2-135M-Instruct with
its weights rounded to bf16, so that both forwards see identical weight values, scores the same
responses (a) built in fp32 and (b) built in bf16 (dtype=bf16, as the trainer runs it; its
per-token logprobs through PolicyRole.logprobs, the trainer's own path). Reported:

- the per-token logprob gap |(b) - (a)| on the response tokens (max, mean, p99), beside the gap
  the fp32 forward's logits alone make when rounded to bf16 (what bf16 logits cost by
  themselves) and the gap of (b) with its output layer's matmul kept in fp32 (what the bf16
  trunk costs by itself: what keeping the logits in fp32 would leave);
- per component, the relative error ||bf16 - fp32|| / ||fp32|| of the embedding output, the
  residual stream after each transformer layer, the final norm's output and the logits, at
  the positions the response tokens read and over all real tokens, so a reader sees whether
  the error grows through the residual stream or appears at the logits;
- (c) bf16 with megatron-core's `fp32_residual_connection`. It does not run as is (the first
  linear layer gets fp32 activations and bf16 weights: the bench prints the error and where);
  (c') runs it with RMSNorm's output cast to the weights' dtype, a patch made in this process
  only (megarlhf is unchanged), as Megatron's mixed-dtype norms do.

Responses: the source model's own samples (HF transformers, fp32, temperature 1.0 as the recipe
samples, no top-k/top-p, seed 0, up to the recipe's 12 new tokens, ending at EOS) to the
first `--prompts` held-out recipe questions, rendered with the recipe's chat template.

    python -m bench.bench_bf16_gap [--prompts 32]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import tempfile
import traceback

import torch

from bench.bench_rlvr import RECIPE, recipe_inputs
from megarlhf.configio import load_config
from megarlhf.convert.mcore_io import single_rank_mesh
from megarlhf.data.templates import PromptFormat
from megarlhf.data.tokenizer import eos_token_ids, load_tokenizer
from megarlhf.engine.checkpoint import load_checkpoint, read_meta
from megarlhf.engine.losses import token_logprobs
from megarlhf.engine.schedule import logit_positions
from megarlhf.engine.train import TrainEngine
from megarlhf.models.config import ModelConfig
from megarlhf.models.gpt import model_spec
from megarlhf.models.layers import RMSNorm
from megarlhf.parallel.mesh import ParallelConfig
from megarlhf.ppo.config import PPOConfig
from megarlhf.roles.batching import Batching, microbatches
from megarlhf.roles.policy import PolicyRole
from megarlhf.rollout.engine import Completion
from megarlhf.rollout.experience import rollout_batch

SEED = 0
ROUTE_TOLERANCE = 1e-5
"""The fp32 logprobs recomputed here from the captured logits must equal PolicyRole's to this:
the same logits through the same softmax, differing at most by fp32 summation order (~1e-6 on
logprobs of order 1-10); a misaligned label or position moves them by whole nats."""


def sample_responses(hf_dir: str, prompts: list[list[int]], max_new_tokens: int
                     ) -> list[list[int]]:
    """The HF model's samples (fp32, temperature 1, no truncation, seed SEED), each cut after
    its first EOS."""
    import transformers

    eos = eos_token_ids(hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    P = max(map(len, prompts))
    ids = torch.tensor([[eos[0]] * (P - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (P - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(SEED)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True,
                             temperature=1.0, top_k=0, top_p=1.0,
                             max_new_tokens=max_new_tokens, eos_token_id=list(eos),
                             pad_token_id=eos[0])
    responses = []
    for row in out[:, P:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        responses.append(row[:end])
    return responses


def build_engine(actor: str, mesh, dtype: torch.dtype, *, fp32_residual: bool = False
                 ) -> TrainEngine:
    """A frozen engine holding the checkpoint `actor` in `dtype` (as engine_from_checkpoint
    builds it), with megatron-core's fp32_residual_connection if asked."""
    spec = model_spec(ModelConfig.from_dict(read_meta(actor)["model"]), ParallelConfig(),
                      dtype=dtype)
    if fp32_residual:
        spec = dataclasses.replace(spec, transformer=dataclasses.replace(
            spec.transformer, fp32_residual_connection=True))
    engine = TrainEngine(spec, mesh)
    load_checkpoint(actor, engine, with_optimizer=False)
    return engine


@torch.no_grad()
def round_to_bf16(engine: TrainEngine) -> None:
    """The fp32 engine's weights rounded to bf16's grid (values in fp32), as the bf16 engine's
    load rounds them."""
    for p in engine.unwrapped()[0].parameters():
        p.copy_(p.to(torch.bfloat16).float())


def check_same_weights(fp32: TrainEngine, bf16: TrainEngine) -> None:
    """Both forwards must see the same weight values, bitwise."""
    wide = dict(fp32.unwrapped()[0].named_parameters())
    for name, p in bf16.unwrapped()[0].named_parameters():
        if not torch.equal(p.float(), wide[name]):
            raise RuntimeError(f"{name}: the bf16 engine's weights differ from the fp32 "
                               f"engine's rounded to bf16")


def components(engine: TrainEngine) -> dict[str, torch.nn.Module]:
    model = engine.unwrapped()[0]
    return {"embedding": model.embedding,
            **{f"layer {i + 1}": layer for i, layer in enumerate(model.decoder.layers)},
            "final norm": model.decoder.final_layernorm, "logits": model.output_layer}


@contextlib.contextmanager
def captured(engine: TrainEngine):
    """Within the block, each component's output of the last forward, in fp32 (a layer's or
    the output layer's first output: the hidden states, the logits)."""
    seen: dict[str, torch.Tensor] = {}

    def keep(name):
        def hook(module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            seen[name] = out.detach().float()
        return hook

    handles = [m.register_forward_hook(keep(n)) for n, m in components(engine).items()]
    try:
        yield seen
    finally:
        for h in handles:
            h.remove()


def score(engine: TrainEngine, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The trainer's per-token logprobs [B, T] and the components' outputs of that pass."""
    with captured(engine) as seen:
        logp = PolicyRole(engine).logprobs(batch)
    if set(seen) != set(components(engine)):
        raise RuntimeError(f"components not run: {sorted(set(components(engine)) - set(seen))}")
    return logp, seen


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where the captured outputs hold real tokens: hidden states [L, R, H] (one micro-batch,
    rows batched: roles/batching.py) and logits [n, R, V] at `positions`."""

    real_LR: torch.Tensor
    positions: torch.Tensor
    """[n] the sequence positions the LM head runs at."""
    reads_nR: torch.Tensor
    """Of those, the ones a response token's logprob reads."""
    labels_nR: torch.Tensor


def layout(engine: TrainEngine, batch) -> Layout:
    """The same micro-batch PolicyRole.logprobs lays out (Batching's defaults)."""
    [mb] = microbatches(engine, Batching(), batch, response_logits=True,
                        response_mask=batch.response_mask)
    if int(mb["col0"]) != 0:
        raise RuntimeError("the micro-batch does not start at the batch's first column")
    R, L = mb["tokens"].shape
    positions = logit_positions(mb, packed=False, mesh=engine.mesh)
    reads = torch.zeros(R * L, dtype=torch.bool)
    reads[mb["logit_index"]] = True
    return Layout(real_LR=(mb["document_ids"] == 0).T, positions=positions,
                  reads_nR=reads.view(R, L)[:, positions].T,
                  labels_nR=mb["labels"][:, positions].T)


def _relative(low: torch.Tensor, ref: torch.Tensor) -> float:
    return float((low - ref).norm() / ref.norm())


def relative_errors(low: dict, ref: dict, where: Layout, vocab: int
                    ) -> dict[str, tuple[float, float]]:
    """Per component, ||low - ref|| / ||ref|| at the positions the response tokens read and
    over all real tokens (logits: real vocabulary, made at the read positions only). From
    layer 12 on, SmolLM2's first token carries a residual norm ~180x the median (measured
    with HF: an attention sink), so the all-tokens norm is that token's; the read positions
    are those the logprobs come from."""
    out = {}
    for name, r in ref.items():
        lo = low[name]
        if lo.shape != r.shape:
            raise RuntimeError(f"{name}: shapes {tuple(lo.shape)} and {tuple(r.shape)} differ")
        if name == "logits":
            read = _relative(lo[..., :vocab][where.reads_nR], r[..., :vocab][where.reads_nR])
            out[name] = (read, read)
            continue
        if lo.shape[:2] != where.real_LR.shape:
            raise RuntimeError(f"{name}: output {tuple(lo.shape)} is not laid out as the "
                               f"micro-batch {tuple(where.real_LR.shape)}")
        at = where.positions
        out[name] = (_relative(lo[at][where.reads_nR], r[at][where.reads_nR]),
                     _relative(lo[where.real_LR], r[where.real_LR]))
    return out


def logits_logprobs(logits_nRV: torch.Tensor, where: Layout, engine: TrainEngine) -> torch.Tensor:
    """Logprobs of the response tokens (row-major) from captured logits [n, R, V]."""
    logp_Rn = token_logprobs(logits_nRV.transpose(0, 1), where.labels_nR.T, engine.mesh,
                             engine.spec.model.vocab_size)
    return logp_Rn[where.reads_nR.T]


@torch.no_grad()
def fp32_head_logits(final_norm_LRH: torch.Tensor, where: Layout, engine: TrainEngine
                     ) -> torch.Tensor:
    """Logits [n, R, V] from a forward's final norm output with the output layer's matmul in
    fp32: a bf16 GEMM that keeps its fp32 accumulation instead of rounding it to bf16."""
    weight = engine.unwrapped()[0].shared_embedding_or_output_weight()
    return torch.nn.functional.linear(final_norm_LRH[where.positions].float(), weight.float())


def gap_stats(a: torch.Tensor, b: torch.Tensor) -> dict[str, float]:
    gap = (a.double() - b.double()).abs()
    if not bool(torch.isfinite(gap).all()):
        raise RuntimeError("non-finite logprob gap")
    return {"max": float(gap.max()), "mean": float(gap.mean()),
            "p99": float(torch.quantile(gap, 0.99))}


@contextlib.contextmanager
def norm_output_in_weight_dtype():
    """This process's RMSNorm returns its weight's dtype: with an fp32 residual stream the
    linear layers after each norm then get bf16 inputs, as Megatron's mixed-dtype norms give
    them. A local experiment; megarlhf's RMSNorm is unchanged."""
    forward = RMSNorm.forward
    RMSNorm.forward = lambda self, x: forward(self, x).to(self.weight.dtype)
    try:
        yield
    finally:
        RMSNorm.forward = forward


def where_it_broke(e: Exception) -> str:
    """The error, the frame that raised it and the innermost transformer-module frame (which
    layer's call)."""
    frames = traceback.extract_tb(e.__traceback__)
    module = next((f for f in reversed(frames) if "megatron/core/transformer/" in f.filename),
                  frames[-1])
    at = lambda f: f"{f.filename.split('site-packages/')[-1]}:{f.lineno} ({f.name})"  # noqa: E731
    return f"{type(e).__name__}: {str(e).splitlines()[0]} at {at(frames[-1])}, in {at(module)}"


def measure(prompts_n: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir, val, inputs = recipe_inputs(tmp)
        config = load_config(PPOConfig, RECIPE, inputs)
        fmt = PromptFormat(load_tokenizer(hf_dir), "auto")
        prompts = [fmt.prompt(row["prompt"]) for row in val[:prompts_n]]
        responses = sample_responses(hf_dir, prompts, config.max_new_tokens)
        batch = rollout_batch(prompts, [
            Completion(prompt_index=i, token_ids=r, logprobs=[0.0] * len(r),
                       finish_reason="stop") for i, r in enumerate(responses)]).sequences
        response = batch.response_mask.bool()
        with single_rank_mesh() as mesh:
            fp32 = build_engine(config.actor, mesh, torch.float32)
            round_to_bf16(fp32)
            where = layout(fp32, batch)
            logp32, seen32 = score(fp32, batch)
            recomputed = logits_logprobs(seen32["logits"], where, fp32)
            route = float((recomputed - logp32[response]).abs().max())
            if route > ROUTE_TOLERANCE:
                raise RuntimeError(f"the logprobs from the captured logits are {route:.2e} "
                                   f"from PolicyRole's (> {ROUTE_TOLERANCE:g})")
            rounded = logits_logprobs(seen32["logits"].bfloat16().float(), where, fp32)
            result = {"gap": {"fp32 logits rounded to bf16": gap_stats(rounded, recomputed)},
                      "error": {}, "tokens": (len(prompts), int(response.sum())),
                      "answer_lengths": [len(r) for r in responses]}

            def compare(name: str, scored) -> None:
                logp, seen = scored
                result["gap"][name] = gap_stats(logp[response], logp32[response])
                result["error"][name] = relative_errors(seen, seen32, where,
                                                        fp32.spec.model.vocab_size)

            bf16 = build_engine(config.actor, mesh, torch.bfloat16)
            check_same_weights(fp32, bf16)
            scored = score(bf16, batch)
            compare("(b) bf16", scored)
            logits = fp32_head_logits(scored[1]["final norm"], where, bf16)
            result["gap"]["(b) bf16, its logits in fp32 (computed here)"] = gap_stats(
                logits_logprobs(logits, where, bf16), logp32[response])
            residual = build_engine(config.actor, mesh, torch.bfloat16, fp32_residual=True)
            check_same_weights(fp32, residual)
            try:
                scored = score(residual, batch)
            except Exception as e:  # noqa: BLE001 - what breaks is the measurement
                result["residual_breaks"] = where_it_broke(e)
                with norm_output_in_weight_dtype():
                    compare("(c') bf16 + fp32 residual, norm out bf16",
                            score(residual, batch))
            else:
                compare("(c) bf16 + fp32_residual_connection", scored)
    return result


def table(result: dict) -> str:
    lines = ["| logprobs vs (a) fp32 | max abs gap | mean | p99 |", "|---|---|---|---|"]
    for name, g in result["gap"].items():
        lines.append(f"| {name} | {g['max']:.4f} | {g['mean']:.5f} | {g['p99']:.4f} |")
    names = list(result["error"])
    lines += ["", "| component: rel. error vs (a) fp32 | " + " | ".join(
        f"{n}: read | {n}: all real" for n in names) + " |",
        "|---" * (1 + 2 * len(names)) + "|"]
    for comp in next(iter(result["error"].values())):
        lines.append(f"| {comp} | " + " | ".join(
            f"{result['error'][n][comp][0]:.2e} | {result['error'][n][comp][1]:.2e}"
            for n in names) + " |")
    prompts, tokens = result["tokens"]
    lengths = result["answer_lengths"]
    lines += ["", f"{prompts} recipe prompts (the first held-out questions), {tokens} response "
              f"tokens: SmolLM2-135M-Instruct's own samples (HF fp32, temperature 1.0, seed "
              f"{SEED}, {min(lengths)}-{max(lengths)} tokens ending at EOS). Weights rounded "
              f"to bf16 for every forward (checked bitwise). Relative error: Frobenius norm "
              f"at the positions the response tokens read ('read') and over all real tokens "
              f"('all real'); layers: the residual stream after the layer; logits: real "
              f"vocabulary, read positions only."]
    if "residual_breaks" in result:
        lines.append(f"\n(c) fp32_residual_connection as is fails: {result['residual_breaks']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    args = parser.parse_args()
    print(table(measure(args.prompts)))


if __name__ == "__main__":
    main()
