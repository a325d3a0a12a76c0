"""Rollouts on our own Megatron GPT model: batched generation with megatron-core's KV cache.

For machines without vLLM (a GPU with only torch, CPUs). One `MegatronEngine` per rank of an
inference mesh at tensor parallel TP_i, PP=1; every TP rank calls every method.

Legend: B rows of the batch (prompts, then prompts x n samples), P prompt columns (prompts are
left-padded to the longest), L columns so far (P + tokens generated), T columns fed in this
step (P at prefill, 1 per decode step), V the real vocabulary, Vp the vocabulary padded for TP.

What megatron-core does and what we do:
- The KV cache is `StaticInferenceContext`, passed to `GPTModel.forward` as
  `inference_context`: megatron's attention appends each step's keys/values to it and attends
  over all cached columns. Its generation loop (`TextGenerationController`) is not used: it
  neither masks left padding nor has repetition penalty, n samples or raw-logit logprobs.
- Padding: we pass an explicit [B, 1, T, L] mask (causal, padding keys masked), which the local
  and SDPA core attentions honour in prefill and decode alike.
- Positions: megatron's RoPE rotates by column, not by `position_ids`. RoPE scores depend only
  on the query-key offset, so the left-padding shift of a row cancels out, exactly as in the
  trainer's forward over the same left-padded batch. We still pass positions that count real
  tokens only (data/sequences.py), which is what any absolute position embedding would need.
- Logits: in inference mode `GPTModel` insists on gathering the vocabulary across TP
  (`runtime_gather_output`), so every rank holds identical full logits [B, Vp]; every rank then
  samples with an identically seeded generator and picks the same token without a broadcast.
  Logprobs come from the vocab-parallel helper over those whole rows (no group needed), which
  drops the padding columns >= V as the trainer's logprobs do; sampling drops them too.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from megatron.core.inference.contexts import StaticInferenceContext

from megarlhf.engine.offload import as_bytes, reallocate, release, storages_of
from megarlhf.models.arch import TensorRule, architecture_for_model, hf_shapes
from megarlhf.models.config import ModelConfig
from megarlhf.models.gpt import ModelSpec, build_model
from megarlhf.models.routing_replay import RoutingReplay
from megarlhf.parallel.mesh import Mesh
from megarlhf.parallel.vocab import vocab_parallel_logprobs
from megarlhf.rollout import projection
from megarlhf.rollout.engine import (
    ENGINE_PARTS, Completion, EngineError, SamplingParams, WeightStream,
)
from megarlhf.rollout.pieces import Piece, Unit, local_pieces
from megarlhf.rollout.weights import WeightCheck


@dataclasses.dataclass(frozen=True, kw_only=True)
class MegatronEngineConfig:
    max_batch_size: int = 64
    """Rows (prompts x n samples) generated together; bounds the KV cache. A prompt's n
    samples always share one batch, so a batch holds max(1, max_batch_size // n) prompts."""
    architecture: str | None = None
    """Registry name that gives the HF weight names ('llama', 'qwen2', ...); None infers it
    from the model config (the Llama family shares one naming)."""
    return_routing: bool = False
    """Return each completion's expert routing (Completion.routing; mixture-of-experts models
    only), for the trainer to replay."""

    def __post_init__(self):
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where one HF tensor goes: the rule it belongs to, the (layer[, expert]) index, its
    position in `rule.hf`."""

    rule: TensorRule
    index: tuple[int, ...]
    position: int

    @property
    def unit(self) -> Unit:
        return self.rule.mcore, self.index


class HFWeights:
    """This rank's shards of a Megatron language model's `chunks`, written from full
    HF-named tensors (a WeightStream): the engine's update_weights, and a frozen TrainEngine
    loaded from an HF directory (the teacher)."""

    def __init__(self, chunks: list[torch.nn.Module], model: ModelConfig, arch_name: str,
                 name: str, *, whole: bool = True):
        """`arch_name`: the architecture whose tensor rules name the model's tensors; `name`:
        the model's, for errors; `whole`: the chunks hold every layer (False: one pipeline
        stage's; the stream's other tensors are checked and passed over)."""
        arch = architecture_for_model(model, arch_name)
        rules = arch.rules(model, lm_head=True, value_head=False)
        self.name, self.num_layers, self.whole = name, model.num_layers, whole
        self._slots = _hf_slots(rules, model)
        self._shapes = hf_shapes(rules, model)
        self._pieces = _pieces_by_unit(local_pieces(chunks))
        self._check_rules_cover_model(chunks, {s.unit for s in self._slots.values()},
                                      arch.name)

    @torch.no_grad()  # a trainable model's parameters are written in place
    def load(self, buckets: WeightStream, device) -> None:
        """Copy every tensor of `buckets` into its shards; ValueError unless each of the
        model's tensors arrives once, of its shape. A rule's HF tensors may arrive in
        different buckets; only incomplete rules are held."""
        check = WeightCheck(self._shapes, f"this model (LM head, {self.num_layers} layers)")
        pending: dict[Unit, list[torch.Tensor | None]] = {}
        for bucket in buckets:
            for name, tensor in bucket:
                check.accept(name, tensor)
                slot = self._slots[name]
                if slot.unit not in self._pieces:  # another pipeline stage's
                    continue
                parts = pending.setdefault(slot.unit, [None] * len(slot.rule.hf))
                parts[slot.position] = tensor
                if all(p is not None for p in parts):
                    self._load_unit(slot, pending.pop(slot.unit), device)
            # The producer may reuse this bucket's memory (copies_each_bucket).
            for parts in pending.values():
                parts[:] = [p if p is None else p.clone() for p in parts]
        check.finish()

    def _load_unit(self, slot: _Slot, parts: list[torch.Tensor], device) -> None:
        pieces = self._pieces[slot.unit]
        full = slot.rule.fuse([p.to(device) for p in parts])
        if slot.rule.vocab:
            full = _pad_rows(full, pieces[0].full_shape[0])
        assert tuple(full.shape) == pieces[0].full_shape, (slot.unit, full.shape)
        for piece in pieces:
            piece.data.copy_(piece.region(full))

    def _check_rules_cover_model(self, chunks: list[torch.nn.Module], rule_units: set[Unit],
                                 arch_name: str) -> None:
        model_units = set(self._pieces)
        if not model_units <= rule_units or (self.whole and model_units != rule_units):
            raise ValueError(
                f"{self.name}: the {arch_name} tensor rules do not match the model: model only "
                f"{sorted(model_units - rule_units, key=str)}, rules only "
                f"{sorted(rule_units - model_units, key=str)}; pass the right architecture")
        params = {p.untyped_storage().data_ptr() for c in chunks for p in c.parameters()}
        assert all(piece.data.untyped_storage().data_ptr() in params
                   for pieces in self._pieces.values() for piece in pieces), \
            "a checkpoint piece is a copy, not a view of a parameter: writes would be lost"


@dataclasses.dataclass
class _Sample:
    token_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    finish_reason: str = "length"
    routing: torch.Tensor | None = None
    first_logprobs: tuple[float, ...] | None = None


class MegatronEngine:
    """The RolloutEngine protocol over a Megatron GPT model built at the mesh's TP (PP=1).

    The model starts without usable weights: `update_weights` must run before `generate`,
    and again after every `wake`.
    """

    copies_each_bucket = True
    """update_weights is done with a bucket before it takes the next (see WeightStream)."""

    def __init__(self, spec: ModelSpec, mesh: Mesh, config: MegatronEngineConfig | None = None):
        _check_layout(spec, mesh)
        self.spec, self.mesh = spec, mesh
        self.config = config or MegatronEngineConfig()
        self.name = f"megatron engine rank {mesh.rank}"
        self.model = build_model(spec, mesh)[0].eval().requires_grad_(False)
        self._weights = HFWeights([self.model], spec.model, self.config.architecture,
                                  self.name)
        if self.config.return_routing and not spec.model.is_moe:
            raise ValueError("return_routing needs a mixture-of-experts model; this one is "
                             "dense")
        self._routing = RoutingReplay([self.model]) if self.config.return_routing else None
        self._weights_ready = False
        self._asleep = False
        self._freed: list[tuple[torch.UntypedStorage, int]] = []
        self._kept: list[torch.Tensor] | None = None

    # ----------------------------------------------------------------------------- generation

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """len(prompts) * params.n completions, a prompt's n samples consecutive."""
        self._check_prompts(prompts, params)
        if not self._weights_ready:
            raise EngineError(f"{self.name}: no weights loaded (the engine is new, asleep, or "
                              f"woke from sleep); call update_weights before generate")
        generator = torch.Generator(device=self.mesh.device)
        generator.manual_seed(self._seed(params))
        per_batch = max(1, self.config.max_batch_size // params.n)
        completions = []
        for start in range(0, len(prompts), per_batch):
            part = list(range(start, min(start + per_batch, len(prompts))))
            try:
                samples = self._generate_batch([prompts[i] for i in part],
                                               params.for_prompts(part), generator)
            except Exception as e:  # noqa: BLE001 - any failure must name this engine
                raise EngineError(f"{self.name}: generation failed: {type(e).__name__}: {e}"
                                  ) from e
            completions += [
                Completion(prompt_index=start + i // params.n, token_ids=s.token_ids,
                           logprobs=s.logprobs, finish_reason=s.finish_reason,
                           routing=s.routing, first_logprobs=s.first_logprobs)
                for i, s in enumerate(samples)
            ]
        return completions

    def _check_prompts(self, prompts: list[list[int]], params: SamplingParams) -> None:
        if not prompts:
            raise ValueError(f"{self.name}: no prompts given")
        vocab = self.spec.model.vocab_size
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise ValueError(f"{self.name}: prompt {i} is empty; every prompt needs at "
                                 f"least one token")
            if min(prompt) < 0 or max(prompt) >= vocab:
                raise ValueError(f"{self.name}: prompt {i} has token ids outside the "
                                 f"vocabulary [0, {vocab})")
        if any(t >= vocab for t in params.first_token_candidates):
            raise ValueError(f"{self.name}: first_token_candidates "
                             f"{params.first_token_candidates} reach outside the vocabulary "
                             f"[0, {vocab})")
        limit = self.spec.model.max_position_embeddings
        length, i = max((len(p) + m, i) for i, (p, m) in
                        enumerate(zip(prompts, params.limits(len(prompts)))))
        if length > limit:
            raise ValueError(f"{self.name}: prompt {i} ({len(prompts[i])} tokens) plus its "
                             f"{length - len(prompts[i])} new tokens exceeds the model's "
                             f"max_position_embeddings={limit}")

    def _seed(self, params: SamplingParams) -> int:
        """The caller's seed, or a fresh one drawn on TP rank 0 and shared, so that every TP
        rank samples the same tokens."""
        if params.seed is not None:
            return params.seed
        seed = torch.randint(0, 2**62, (1,), device=self.mesh.device)
        if self.mesh.tp > 1:
            dist.broadcast(seed, src=dist.get_global_rank(self.mesh.tp_group, 0),
                           group=self.mesh.tp_group)
        return int(seed.item())

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams,
                        generator: torch.Generator) -> list[_Sample]:
        if self._routing is None:
            samples, _ = self._sample(prompts, params, generator)
            return samples
        with self._routing.record():
            samples, fed = self._sample(prompts, params, generator)
        _attach_routing(samples, prompts, params.n, fed, self._routing.take_recorded())
        return samples

    @torch.no_grad()
    def _sample(self, prompts: list[list[int]], params: SamplingParams,
                generator: torch.Generator) -> tuple[list[_Sample], list[list[int]]]:
        """The samples, and the samples each decode step fed (in batch-row order)."""
        limits = params.limits(len(prompts))
        ctx, logits_BV, real_BL, seen_BV = self._prefill(prompts, params, max(limits))
        device = self.mesh.device
        stop_ids = torch.tensor(params.stop_token_ids, dtype=torch.long, device=device)
        limit_B = torch.tensor(limits, device=device).repeat_interleave(params.n)
        samples = [_Sample() for _ in range(len(real_BL))]
        if params.first_token_candidates:
            _record_first(samples, logits_BV[:, :self.spec.model.vocab_size],
                          params.first_token_candidates)
        alive = list(range(len(samples)))  # the sample each batch row extends
        fed = []
        for step in range(max(limits)):
            token_B, logp_B = self._choose(logits_BV, seen_BV, params, generator)
            stopped_B = torch.isin(token_B, stop_ids)
            _record(samples, alive, token_B, logp_B, stopped_B)
            done_B = stopped_B | (limit_B <= step + 1)
            if bool(done_B.all()):
                break
            if bool(done_B.any()):
                # Finished rows leave the batch: they stop growing and cost nothing more.
                keep_B = (~done_B).nonzero().squeeze(1)
                alive = [alive[i] for i in keep_B.tolist()]
                token_B, real_BL, limit_B = token_B[keep_B], real_BL[keep_B], limit_B[keep_B]
                seen_BV = seen_BV[keep_B] if seen_BV is not None else None
                _select_rows(ctx, keep_B)
            if seen_BV is not None:
                seen_BV.scatter_(1, token_B[:, None], True)
            real_BL = torch.cat([real_BL, torch.ones_like(real_BL[:, :1])], dim=1)
            fed.append(list(alive))
            logits_BV = self._step(token_B[:, None], real_BL, ctx)
        return samples, fed

    def _prefill(self, prompts: list[list[int]], params: SamplingParams, new_tokens: int):
        """Encode the prompts once, then give each of its n samples a copy of its cache rows:
        (context, last logits [B, Vp], real-token mask [B, P], ids seen [B, V] or None), with
        B = len(prompts) * n, a prompt's samples consecutive; room for `new_tokens` more
        columns."""
        tokens_BP, real_BP = _left_pad(prompts, self.mesh.device)
        ctx = StaticInferenceContext(max_batch_size=len(prompts),
                                     max_sequence_length=tokens_BP.shape[1] + new_tokens)
        logits_BV = self._step(tokens_BP, real_BP, ctx)
        ctx.enable_decode_mode()
        rows_B = torch.arange(len(prompts), device=self.mesh.device).repeat_interleave(params.n)
        _select_rows(ctx, rows_B)
        tokens_BP, real_BP = tokens_BP[rows_B], real_BP[rows_B]
        seen_BV = (_seen_tokens(tokens_BP, real_BP, self.spec.model.vocab_size)
                   if params.repetition_penalty != 1 else None)
        return ctx, logits_BV[rows_B], real_BP, seen_BV

    def _step(self, tokens_BT: torch.Tensor, real_BL: torch.Tensor,
              ctx: StaticInferenceContext) -> torch.Tensor:
        """Feed the last T columns; logits [B, Vp] (all TP ranks) of the last column."""
        T = tokens_BT.shape[1]
        positions_BL = (real_BL.cumsum(dim=1) - 1).clamp(min=0)
        logits_B1V = self.model(tokens_BT, positions_BL[:, -T:], _attention_mask(real_BL, T),
                                inference_context=ctx, runtime_gather_output=True)
        ctx.increment_sequence_len_offset(T)
        return logits_B1V[:, -1]

    def _choose(self, logits_BV: torch.Tensor, seen_BV: torch.Tensor | None,
                params: SamplingParams, generator: torch.Generator):
        """(token [B], log p(token) [B] under the raw logits) of the next step."""
        vocab = self.spec.model.vocab_size
        raw_BV = logits_BV[:, :vocab].float()  # padding ids can never be chosen
        z_BV = raw_BV
        if seen_BV is not None:
            z_BV = _penalize_repeats(z_BV, seen_BV, params.repetition_penalty)
        if params.greedy:
            token_B = z_BV.argmax(dim=-1)
        else:
            probs_BV = torch.softmax(_truncate(z_BV / params.temperature, params), dim=-1)
            token_B = _draw(probs_BV, generator)
        logp_B = vocab_parallel_logprobs(raw_BV[:, None], token_B[:, None], tp_group=None,
                                         vocab_start=0, vocab_size=vocab)[:, 0]
        return token_B, logp_B

    # -------------------------------------------------------------------------------- weights

    def output_products(self, probe: torch.Tensor) -> tuple[int, torch.Tensor]:
        """(first vocabulary row of this rank, [rows, K] products of the output projection it
        computes with and the [H, K] `probe`): its parameter, which the LM head's matmul
        reads as it is (rollout/projection)."""
        model = self.model
        weight = model.shared_embedding_or_output_weight() \
            if model.share_embeddings_and_output_weights else model.output_layer.weight
        start = self.mesh.tp_rank * weight.shape[0]
        rows = max(0, min(weight.shape[0], self.spec.model.vocab_size - start))
        return start, projection.products(weight[:rows], probe)

    @torch.no_grad()
    def update_weights(self, buckets: WeightStream) -> None:
        """Copy full HF-named tensors into this rank's shards. A rule's HF tensors may arrive
        in different buckets; only incomplete rules are held. Every parameter must arrive."""
        if self._asleep:
            raise EngineError(f"{self.name}: asleep; call wake() before update_weights")
        self._weights_ready = False  # a failed update leaves a half-written model
        self._kept = None  # a host copy of other weights
        try:
            self._weights.load(buckets, self.mesh.device)
        except ValueError as e:
            raise ValueError(f"{self.name}: {e}") from None
        self._weights_ready = True

    # ---------------------------------------------------------------------- sleep / lifecycle

    def sleep(self, keep_weights: bool = False) -> None:
        """Free the weights' memory (storage resized to 0; the parameter objects and the views
        our pieces hold stay valid). The KV cache exists only inside generate(), so there is
        none to drop between calls. `keep_weights`: loaded weights are copied to host memory
        first (pinned, on a GPU; once: the copy stays until update_weights) and wake() puts
        them back, so no update_weights is needed (weights that never change: a judge's)."""
        if self._asleep:
            return
        # Tied weights share one storage: freed once.
        storages = list(storages_of([self.model.parameters()]).values())
        if not (keep_weights and self._weights_ready):
            self._kept = None
        elif self._kept is None:
            self._kept = [_host_copy(s) for s in storages]
        self._freed = release(storages)
        self._asleep, self._weights_ready = True, False

    def wake(self, parts: tuple[str, ...] = ENGINE_PARTS) -> None:
        """Allocate the weights' memory again: the weights sleep(keep_weights=True) kept, or
        contents undefined until update_weights. The KV cache is allocated by each
        generate()."""
        if not self._asleep or "weights" not in parts:
            return
        reallocate(self._freed)
        if self._kept is not None:
            for (storage, _), kept in zip(self._freed, self._kept):
                as_bytes(storage).copy_(kept)
            self._weights_ready = True
        self._freed, self._asleep = [], False

    def device_bytes(self) -> int:
        """The bytes of the weights held now (0 asleep)."""
        return sum(s.nbytes() for s in storages_of([self.model.parameters()]).values())

    def shutdown(self) -> None:
        self.sleep()


def _check_layout(spec: ModelSpec, mesh: Mesh) -> None:
    problems = []
    if mesh.pp > 1 or mesh.config.virtual_pipeline_parallel:
        problems.append(f"pipeline_parallel={mesh.pp} (virtual "
                        f"{mesh.config.virtual_pipeline_parallel}): the engine generates at "
                        f"PP=1 only; give it a mesh with tensor parallelism alone")
    if mesh.cp > 1:
        problems.append(f"context_parallel={mesh.cp}: the engine's KV cache holds whole "
                        f"sequences; give it a mesh without context parallelism")
    if mesh.ep > 1:
        problems.append(f"expert_parallel={mesh.ep}: expert-parallel ranks must run every "
                        f"forward together, and each rank's generation stops on its own; give "
                        f"it a mesh without expert parallelism")
    if mesh.config.sequence_parallel or spec.transformer.sequence_parallel:
        problems.append("sequence_parallel=True: megatron-core's static KV cache does not "
                        "support it; use an inference mesh and model spec without it (the "
                        "weights are the same)")
    if spec.transformer.tensor_model_parallel_size != mesh.tp:
        problems.append(f"the model spec is for TP={spec.transformer.tensor_model_parallel_size}"
                        f" but the mesh has TP={mesh.tp}; build the spec from the mesh's config")
    if spec.value_head:
        problems.append("the model has a value head; generation needs the LM head")
    if spec.layer_spec == "te":
        problems.append("layer spec 'te': padding masks through Transformer Engine attention "
                        "are not verified here; use 'sdpa' or 'local'")
    if problems:
        raise ValueError("MegatronEngine cannot run this model: " + "; ".join(problems))


def _hf_slots(rules: list[TensorRule], model: ModelConfig) -> dict[str, _Slot]:
    return {name: _Slot(rule, index, position) for rule in rules
            for index in rule.indices(model)
            for position, name in enumerate(rule.hf_names(index))}


def _pieces_by_unit(pieces: list[Piece]) -> dict[Unit, list[Piece]]:
    by_unit: dict[Unit, list[Piece]] = {}
    for piece in pieces:
        by_unit.setdefault(piece.unit, []).append(piece)
    return by_unit


def _pad_rows(full: torch.Tensor, rows: int) -> torch.Tensor:
    """Vocabulary tensors get zero rows up to the TP-padded vocabulary (never sampled)."""
    return torch.cat([full, full.new_zeros(rows - full.shape[0], *full.shape[1:])])


def _left_pad(prompts: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B, P], real [B, P]: 1 on prompt tokens, 0 on left padding)."""
    P = max(map(len, prompts))
    tokens = torch.zeros(len(prompts), P, dtype=torch.long, device=device)
    real = torch.zeros_like(tokens)
    for row, prompt in enumerate(prompts):
        tokens[row, P - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        real[row, P - len(prompt):] = 1
    return tokens, real


def _attention_mask(real_BL: torch.Tensor, T: int) -> torch.Tensor:
    """[B, 1, T, L] bool, True = masked, for queries at the last T of L columns: causal, no
    padding keys, and a padding query sees itself so no softmax row is empty (its output is
    never used) - the same rule as data/sequences.py."""
    L = real_BL.shape[1]
    q_cols = torch.arange(L - T, L, device=real_BL.device)[:, None]
    k_cols = torch.arange(L, device=real_BL.device)[None, :]
    allowed = (k_cols <= q_cols) & real_BL.bool()[:, None, None, :] | (k_cols == q_cols)
    return ~allowed


def _record(samples: list[_Sample], alive: list[int], token_B: torch.Tensor,
            logp_B: torch.Tensor, stopped_B: torch.Tensor) -> None:
    for row, token, logp, stopped in zip(alive, token_B.tolist(), logp_B.tolist(),
                                         stopped_B.tolist()):
        samples[row].token_ids.append(token)
        samples[row].logprobs.append(logp)
        if stopped:
            samples[row].finish_reason = "stop"


def _record_first(samples: list[_Sample], logits_BV: torch.Tensor,
                  candidates: tuple[int, ...]) -> None:
    """Each sample's log p of the candidate ids at its first new token (raw logits)."""
    ids = torch.tensor(candidates, device=logits_BV.device)
    logp_BC = torch.log_softmax(logits_BV.float(), dim=-1)[:, ids]
    for sample, row in zip(samples, logp_BC.tolist()):
        sample.first_logprobs = tuple(row)


def _attach_routing(samples: list[_Sample], prompts: list[list[int]], n: int,
                    fed: list[list[int]], calls: list[torch.Tensor]) -> None:
    """Each sample's routing [tokens it was routed for, layers, k] from the recorded calls:
    the prefill's [P * prompts] tokens (sequence-major, as megatron-core's activations are;
    left padding dropped), then one token per decode step the sample took part in: its prompt
    and every response token but the last, which no step fed."""
    calls = [call.cpu() for call in calls]  # one copy each, not one per sample
    prefill, decodes = calls[0], calls[1:]
    P = max(map(len, prompts))
    prefill = prefill.view(P, len(prompts), *prefill.shape[1:])
    steps: list[list[torch.Tensor]] = [[] for _ in samples]
    for rows, call in zip(fed, decodes, strict=True):
        for row, sample in enumerate(rows):
            steps[sample].append(call[row])
    for i, sample in enumerate(samples):
        prompt = prefill[P - len(prompts[i // n]):, i // n]
        routing = torch.cat([prompt, torch.stack(steps[i])]) if steps[i] else prompt
        sample.routing = routing.clone()  # not a view that would keep the whole call


def _select_rows(ctx: StaticInferenceContext, rows: torch.Tensor) -> None:
    """Keep (or repeat) KV cache rows in this order. `StaticInferenceContext.
    swap_key_value_dict` only permutes (it asserts an unchanged batch size)."""
    for layer, (keys, values) in ctx.key_value_memory_dict.items():
        ctx.key_value_memory_dict[layer] = (keys[:, rows], values[:, rows])  # [S, B, groups, d]
    ctx.max_batch_size = len(rows)


def _seen_tokens(tokens_BP: torch.Tensor, real_BP: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, V] bool: which ids occur in each row's prompt (padding excluded)."""
    seen = torch.zeros(tokens_BP.shape[0], vocab, dtype=torch.bool, device=tokens_BP.device)
    rows, cols = real_BP.nonzero(as_tuple=True)
    seen[rows, tokens_BP[rows, cols]] = True
    return seen


def _penalize_repeats(z_BV: torch.Tensor, seen_BV: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL / HF / vLLM repetition penalty over prompt and generated ids: positive logits are
    divided by it, negative ones multiplied."""
    penalized = torch.where(z_BV > 0, z_BV / penalty, z_BV * penalty)
    return torch.where(seen_BV, penalized, z_BV)


def _truncate(z_BV: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Top-k, then top-p (the smallest set of ids whose probability reaches p): the rest -inf."""
    if 0 < params.top_k < z_BV.shape[-1]:
        kth = z_BV.topk(params.top_k, dim=-1).values[:, -1:]
        z_BV = z_BV.masked_fill(z_BV < kth, float("-inf"))
    if params.top_p < 1:
        sorted_z, order = z_BV.sort(dim=-1, descending=True)
        probs = sorted_z.softmax(dim=-1)
        # Drop an id when the ids ranked above it already reach p; the top id always stays.
        drop_sorted = probs.cumsum(dim=-1) - probs >= params.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        z_BV = z_BV.masked_fill(drop, float("-inf"))
    return z_BV


def _draw(probs_BV: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One id per row, drawn with its probability: where one uniform number falls in the
    row's cumulative distribution. torch.multinomial draws an exponential number per
    vocabulary entry instead (15 ms a decode step at a 49k vocabulary and 16 rows on one CPU
    core, 5% of the step). The sums are in float64 so that each id's share of [0, total)
    is its probability to ~1e-16; ids of probability 0 (truncated) have an empty share and
    are never drawn. Logits that are not finite (a diverged model) raise, as
    torch.multinomial does, rather than draw an id from a meaningless distribution."""
    cdf_BV = probs_BV.cumsum(dim=-1, dtype=torch.float64)
    total_B1 = cdf_BV[:, -1:]
    if not bool((total_B1 > 0).all() & total_B1.isfinite().all()):
        raise ValueError("the sampling probabilities are not finite (NaN or inf logits)")
    u_B1 = torch.rand(total_B1.shape, generator=generator, dtype=torch.float64,
                      device=probs_BV.device) * total_B1
    token_B = torch.searchsorted(cdf_BV, u_B1, right=True).squeeze(1)
    # u * total can round up to total itself: that is the last id with a share.
    return torch.minimum(token_B, cdf_BV.argmax(dim=-1))


def _host_copy(storage: torch.UntypedStorage) -> torch.Tensor:
    """The storage's bytes in host memory (pinned when the storage is on a GPU, for the copy
    back)."""
    data = as_bytes(storage)
    if data.device.type == "cpu":
        return data.clone()
    return torch.empty(data.shape, dtype=torch.uint8, pin_memory=True).copy_(data)
