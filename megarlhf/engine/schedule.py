"""Micro-batched forward(/backward) through megatron-core's pipeline schedules.

A micro-batch is a dict of tensors with the same keys for every micro-batch of a call;
`tokens` [B, T] is required, `position_ids` [B, T] and `document_ids` [B, T] are optional:
with document ids each token attends causally to the earlier tokens of its own id, without
them attention is causal. A micro-batch whose rows pack several documents runs as one row of
B*T tokens cut into segments (models/packed.py: no mask, no attention across documents
computed); otherwise, and always under context parallelism, the rows run with the document
mask (data/packing.document_mask, made on the device for the positions this rank runs).
Rows that continue a prompt several times (roles/batching.py's shared prompts) add
`shared_prompt` [B, T] (keys every later position of the row sees) and `rotary_columns` [T]
(the position each column's RoPE angle is that of: models/gpt.rotary_at) and run with the
mask.
Shapes may differ between micro-batches (token-budget micro-batches, roles/batching.py): the
pipeline stages then send each activation's shape ahead of it. Every pipeline stage receives
the whole dict: later stages need the mask and positions, and the loss closure on the last
stage needs labels.

A micro-batch may name the positions its loss reads an LM's logits at (`logit_index`): the
LM head then runs there only (models/gpt.logits_at), the per-position step gets the logits of
those positions with their positions in `inputs["logit_positions"]`.

A loss closure `loss_fn(batch, output) -> (loss_sum, num_tokens, metrics: dict)` runs on the
last stage; with `calculate_per_token_loss` the schedules keep token sums and megatron-core
divides gradients by the token count of the whole global batch. A `Loss` pairs a closure with
a per-position step run first on the model's raw output (an LM's logits -> log-probabilities):
the closure then gets that step's result.

Under context parallelism the batch stays whole: the model runs on this CP rank's share of
the sequence, the per-position step on the same share (with the model inputs and labels of
those positions), its result is gathered back to whole rows before the closure
(models/context_parallel.py), and only CP rank 0 counts the tokens, so the count
megatron-core sums over DP x CP is the batch's. An LM's logits are never gathered whole when
its loss reduces them per position first.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.utils import get_model_config

from megarlhf.models import context_parallel
from megarlhf.models.gpt import logits_at, rotary_at
from megarlhf.models.packed import flatten, packed_segments, unflatten
from megarlhf.models.routing_replay import RoutingReplay, local_order
from megarlhf.parallel.mesh import Mesh

Batch = dict[str, torch.Tensor]
LossFn = Callable[[Batch, torch.Tensor], tuple[torch.Tensor, torch.Tensor, dict]]


@dataclasses.dataclass(frozen=True)
class Loss:
    """A loss closure with the per-position step applied to the model's output first:
    `per_position(inputs, output) -> [B, T, ...]`, where `inputs` holds the model-layout
    tensors (tokens, labels, position_ids, attention_mask) of the positions `output` covers."""

    closure: LossFn
    per_position: Callable[[Batch, torch.Tensor], torch.Tensor]


def check_microbatches(microbatches: list[Batch]) -> set[tuple[int, int]]:
    """The micro-batches' (batch, seq) shapes; raise if one lacks tokens [batch, seq] or
    their keys differ."""
    if not microbatches:
        raise ValueError("no micro-batches given")
    keys = set(microbatches[0])
    for i, mb in enumerate(microbatches):
        if "tokens" not in mb or mb["tokens"].dim() != 2:
            raise ValueError(f"micro-batch {i} needs 'tokens' of shape [batch, seq]")
        if set(mb) != keys:
            raise ValueError(f"micro-batch {i} has keys {sorted(mb)}, micro-batch 0 has "
                             f"{sorted(keys)}")
    return {tuple(mb["tokens"].shape) for mb in microbatches}


def forward_backward(
    chunks: list[torch.nn.Module],
    mesh: Mesh,
    microbatches: list[Batch],
    loss_fn: LossFn | Loss,
    *,
    forward_only: bool,
    replay: RoutingReplay | None = None,
) -> list[dict]:
    """Run all micro-batches through the pipeline; return the loss closures' metric dicts.

    The list is filled on the last pipeline stage and empty elsewhere (see `from_last_stage`).
    Micro-batches with `routing` [B, T, layers, k] (model layout, -1: the router chooses)
    have it fed to `replay`'s routers as each chunk runs them.
    """
    check_microbatches(microbatches)
    # Micro-batches that pack documents run as one row of B*T tokens (models/packed.py),
    # except under context parallelism, whose attention takes the document mask.
    # Rows that continue a shared prompt several times (roles/batching.py) take their mask.
    layouts = [packed_segments(mb["document_ids"], mesh.device)
               if mesh.cp == 1 and "document_ids" in mb and "shared_prompt" not in mb
               else None for mb in microbatches]
    shapes = {(1, mb["tokens"].numel()) if seg else tuple(mb["tokens"].shape)
              for mb, seg in zip(microbatches, layouts)}
    replaying = "routing" in microbatches[0]
    if replaying and replay is None:
        raise ValueError("micro-batches carry an expert routing, but the model has no "
                         "mixture-of-experts layers")
    micro_batch_size, seq_length = next(iter(shapes))
    # Pipeline stages size their receive buffers from seq_length x micro_batch_size unless
    # told to exchange shapes first (an extra small message per send): set per call, on the
    # config the schedules read.
    get_model_config(chunks[0]).variable_seq_lengths = len(shapes) > 1
    device = mesh.device

    closure, per_position = (loss_fn.closure, loss_fn.per_position) \
        if isinstance(loss_fn, Loss) else (loss_fn, None)

    def loss_on_whole_rows(batch, inputs, out):
        if per_position is not None:
            out = per_position(inputs, out)
        if "packed_seq_params" in inputs:
            out = unflatten(out, *batch["tokens"].shape)
        loss, num_tokens, metrics = closure(batch, context_parallel.gather_sequence(out, 1, mesh))
        return loss, num_tokens if mesh.cp_rank == 0 else num_tokens * 0, metrics

    sequence_parallel = get_model_config(chunks[0]).sequence_parallel

    def forward_step(data_iterator, model):
        host, seg = next(data_iterator)
        batch = {k: v.to(device) for k, v in host.items()}
        if seg is not None:
            inputs = flatten(batch, context_parallel.MODEL_LAYOUT)
            inputs["packed_seq_params"] = seg
        else:
            inputs = context_parallel.local_inputs(batch, mesh)
        if replaying:
            replay.feed(model, local_order(inputs.pop("routing"), mesh, sequence_parallel))
        positions = logit_positions(batch, packed=seg is not None, mesh=mesh)
        if positions is not None:
            inputs["logit_positions"] = positions
        with logits_at(model, positions), rotary_at(model, batch.get("rotary_columns")):
            output = model(inputs["tokens"], inputs.get("position_ids"),
                           inputs.get("attention_mask"),
                           packed_seq_params=inputs.get("packed_seq_params"))
        return output, lambda out: loss_on_whole_rows(batch, inputs, out)

    iterators = [zip(microbatches, layouts) for _ in chunks]
    with replay.replay() if replaying else contextlib.nullcontext():
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators if len(chunks) > 1 else iterators[0],
            model=chunks if len(chunks) > 1 else chunks[0],
            num_microbatches=len(microbatches),
            seq_length=seq_length,
            micro_batch_size=micro_batch_size,
            forward_only=forward_only,
        )


def logit_positions(batch: Batch, *, packed: bool, mesh: Mesh) -> torch.Tensor | None:
    """The sequence positions at which the model needs its LM head for a micro-batch that
    names them (`logit_index`, flat in its R x L positions; roles/batching.py): the flat
    positions themselves when its rows run as one packed row, else the columns any row
    needs. None (everywhere) under context parallelism, where a rank runs chunks of the
    sequence."""
    index = batch.get("logit_index")
    if index is None or mesh.cp > 1:
        return None
    return index if packed else (index % batch["tokens"].shape[1]).unique()


def from_last_stage(obj, mesh: Mesh):
    """Give every pipeline stage the object the last stage holds (small objects only)."""
    if mesh.pp == 1:
        return obj
    box = [obj if mesh.is_last_stage else None]
    dist.broadcast_object_list(box, src=mesh.last_stage_rank, group=mesh.pp_group)
    return box[0]


def outputs_from_last_stage(out: list[dict], mesh: Mesh) -> list[dict]:
    """The loss closures' dicts of tensors on every stage: their layout (keys, shapes, dtypes)
    goes as a small object, the tensors by tensor broadcasts (per-token outputs of a PPO batch
    are megabytes, too slow to pickle)."""
    if mesh.pp == 1:
        return out
    layout = from_last_stage([{k: (tuple(v.shape), v.dtype) for k, v in d.items()}
                              for d in out] if mesh.is_last_stage else None, mesh)
    if not mesh.is_last_stage:
        out = [{k: torch.empty(shape, dtype=dtype, device=mesh.device)
                for k, (shape, dtype) in d.items()} for d in layout]
    for d in out:
        for key in sorted(d):
            d[key] = d[key].contiguous()
            dist.broadcast(d[key], src=mesh.last_stage_rank, group=mesh.pp_group)
    return out


def gather_rows(out: list[dict], key: str, mesh: Mesh) -> torch.Tensor:
    """`key` of the closures' dicts, concatenated over this rank's micro-batches and then over
    DP ranks: the global batch's rows, in order, on every rank (call after from_last_stage)."""
    local = torch.cat([d[key] for d in out])
    parts = [torch.empty_like(local) for _ in range(mesh.dp_size)]
    dist.all_gather(parts, local.contiguous(), group=mesh.dp_group)
    return torch.cat(parts)


def pad_to_multiple(batch: Batch, multiple: int) -> Batch:
    """`batch` with its sequence dimension padded on the right to a multiple of `multiple`
    (sequence and context parallelism split it): [B, T] tensors with 0, document ids with
    new ids of their own (no real token sees a padding key, a padding query sees only
    itself). Per-row tensors [B] are kept; nothing reads the padded positions' outputs."""
    T = batch["tokens"].shape[1]
    pad = -T % multiple
    if pad == 0:
        return batch
    out = {}
    for key, value in batch.items():
        if not (value.dim() == 2 and value.shape[1] == T):
            out[key] = value  # per-row, or rows of another width (KTO's kl_*)
        elif key.endswith("document_ids"):  # also another row set's (kl_document_ids)
            fresh = value.min() - torch.arange(1, pad + 1)
            out[key] = torch.cat([value, fresh.expand(value.shape[0], pad)], dim=1)
        else:
            out[key] = torch.nn.functional.pad(value, (0, pad))
    return out


def rank_rows(rows: int, dp_size: int, dp_rank: int, num_microbatches: int) -> list[range]:
    """The rows of this DP rank's equal micro-batches: a contiguous share of the batch."""
    if rows % (dp_size * num_microbatches):
        raise ValueError(
            f"global batch of {rows} rows does not split into {dp_size} DP ranks x "
            f"{num_microbatches} micro-batches; use a multiple of "
            f"{dp_size * num_microbatches}"
        )
    size = rows // (dp_size * num_microbatches)
    start = dp_rank * rows // dp_size
    return [range(start + i * size, start + (i + 1) * size) for i in range(num_microbatches)]


def rank_microbatches(batch: Batch, mesh: Mesh, num_microbatches: int) -> list[Batch]:
    """This DP rank's contiguous share of a global batch, cut into equal micro-batches."""
    return [{k: v[r.start:r.stop] for k, v in batch.items()}
            for r in rank_rows(batch["tokens"].shape[0], mesh.dp_size, mesh.dp_rank,
                               num_microbatches)]
