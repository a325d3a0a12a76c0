"""Resharding bridge: trained Megatron weights (any TP / PP / virtual PP / DP) -> HF-named
tensors for a rollout engine, in buckets of bounded size.

Every rank computes the same `BridgePlan` from the model config and the pipeline stages that
hold each tensor: an ordered list of buckets, each owned by one pipeline stage and holding the
HF tensors of some whole Megatron tensors (a layer's fused QKV, an embedding ...). Per bucket:

1. the owning stage's TP ranks all-gather one Megatron tensor at a time (its full per-layer
   form, assembled from Megatron's own shard offsets), split it with the architecture's
   `TensorRule` into HF tensors (views, cast to the rollout dtype where it differs);
2. colocated without pipeline stages, the engine gets those tensors as they are; otherwise
   they are copied into one flat buffer, broadcast over the pipeline group (colocated) or a
   separate channel to the engine's processes (disaggregated, `send` / `receive`);
3. the engine gets (HF name, tensor) pairs; an engine that copies each bucket before asking
   for the next lets the bridge reuse one buffer across buckets and syncs
   (`stream(reuse_buffer=True)`), others get a fresh buffer per bucket.

DP replicas hold the same weights, so each replica serves its own ranks in colocated mode and
only replica 0 sends in disaggregated mode. A mixture-of-experts layer's experts are split
over the EP ranks (which regroup TP x CP x DP ranks of a stage): an expert's tensor is
assembled on the EP rank holding it (over its expert-TP group) and broadcast over the EP group,
so every rank that streams has every expert, one tensor at a time. Extra memory per rank is
one bucket plus the assembly of the largest single tensor (`BridgePlan.peak_extra_bytes`).
"""

from __future__ import annotations

import dataclasses
import pickle
from collections import defaultdict
from typing import Iterator

import torch
import torch.distributed as dist

from megarlhf.models.arch import Architecture, layer_major
from megarlhf.models.config import ModelConfig
from megarlhf.models.lora import LoraConfig, adapter_keys, is_adapter_key, merged
from megarlhf.parallel.mesh import Mesh
from megarlhf.rollout.delta import DeltaChannel
from megarlhf.rollout.engine import WeightStream
from megarlhf.rollout.pieces import Piece, Unit, local_pieces

DEFAULT_BUCKET_BYTES = 512 * 1024**2


@dataclasses.dataclass(frozen=True)
class Slot:
    name: str
    shape: tuple[int, ...]
    offset: int
    """Element offset in the bucket buffer."""

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


@dataclasses.dataclass(frozen=True)
class Bucket:
    stage: int
    """Pipeline rank whose ranks hold these tensors."""
    units: tuple[Unit, ...]
    slots: tuple[tuple[Slot, ...], ...]
    """Per unit, its HF tensors in the rule's order."""
    numel: int


@dataclasses.dataclass(frozen=True)
class BridgePlan:
    dtype: torch.dtype
    buckets: tuple[Bucket, ...]
    largest_unit_bytes: int
    """Bytes of the largest Megatron tensor in the training dtype (its full, padded form)."""
    merge_bytes: int = 0
    """With LoRA: the merge of the largest adapted HF tensor (an fp32 copy and its result,
    in the training dtype)."""

    @property
    def names(self) -> list[str]:
        return [s.name for b in self.buckets for unit in b.slots for s in unit]

    @property
    def peak_extra_bytes(self) -> int:
        """Most memory a rank allocates at once while streaming: the largest bucket, plus
        (on an owning rank) the TP all-gather, the assembled tensor and its HF split of the
        largest single tensor, and with LoRA the merge of the largest adapted one."""
        item = torch.empty((), dtype=self.dtype).element_size()
        return max(b.numel for b in self.buckets) * item + 3 * self.largest_unit_bytes \
            + self.merge_bytes


class WeightBridge:
    """Built collectively by all training ranks of `mesh` (it exchanges shard metadata)."""

    def __init__(self, chunks: list[torch.nn.Module], mesh: Mesh, model: ModelConfig,
                 arch: Architecture, *, dtype: torch.dtype | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, lora: LoraConfig | None = None):
        """`lora`: the chunks' adapters, merged into each adapted projection as it streams."""
        if bucket_bytes <= 0:
            raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
        self.mesh, self.model, self.lora = mesh, model, lora
        self._rules = {r.mcore: r for r in arch.rules(model, lm_head=True, value_head=False)}
        self._pieces: dict[Unit, list[Piece]] = defaultdict(list)
        self._arch_name = arch.name
        for piece in local_pieces(chunks):
            self._pieces[piece.unit].append(piece)
        train_dtype = next(iter(self._pieces.values()))[0].data.dtype
        self._peer_offsets = self._exchange_tp_offsets()
        self.plan = self._make_plan(dtype or train_dtype, bucket_bytes, train_dtype)
        self._flat: torch.Tensor | None = None

    # -- planning (collective, once) ------------------------------------------------------

    def _split_group(self, unit: Unit) -> tuple[dist.ProcessGroup, int]:
        """The ranks whose pieces make up `unit`: the TP group, or for an expert's tensor the
        expert-TP group (the ranks splitting that expert)."""
        if _is_expert(unit):
            return self.mesh.expert_tp_group, self.mesh.config.expert_tp
        return self.mesh.tp_group, self.mesh.tp

    def _exchange_tp_offsets(self) -> dict[Unit, list[list[tuple[int, ...]]]]:
        """Per unit and local piece, every TP (expert-TP) rank's offsets (the gather needs to
        know where the other ranks' pieces go)."""
        offsets = {}
        for experts in (False, True):
            mine = {unit: [p.offsets for p in pieces] for unit, pieces in self._pieces.items()
                    if _is_expert(unit) == experts}
            group = self.mesh.expert_tp_group if experts else self.mesh.tp_group
            everyone = [None] * dist.get_world_size(group)
            dist.all_gather_object(everyone, mine, group=group)
            offsets.update({unit: [[peer[unit][i] for peer in everyone]
                                   for i in range(len(mine[unit]))] for unit in mine})
        return offsets

    def _check_mappable(self, stages: list[dict]) -> None:
        """Same verdict on every rank (all see every stage), so no rank is left waiting."""
        unknown = sorted({key for units in stages for key, _ in units} - set(self._rules))
        if unknown:
            raise ValueError(f"the {self._arch_name} bridge cannot map Megatron tensors "
                             f"{unknown}; only LMs (actor weights) of that architecture stream "
                             f"to rollout engines - is this a value model or another "
                             f"architecture?")

    def _units_in_order(self) -> list[Unit]:
        whole = [(r.mcore, ()) for r in self._rules.values() if not r.per_layer]
        layered = [(rule.mcore, index)
                   for rule, index in layer_major(list(self._rules.values()), self.model)]
        return whole[:1] + layered + whole[1:]  # embedding, layers, final norm / head

    def _make_plan(self, dtype: torch.dtype, bucket_bytes: int,
                   train_dtype: torch.dtype) -> BridgePlan:
        # Adapters have no HF tensor of their own: they stream merged into their base's.
        if self.lora is None and any(is_adapter_key(unit[0]) for unit in self._pieces):
            raise ValueError("the model has LoRA adapters but the weight bridge was given no "
                             "lora config: the engines would get the base without them")
        held = {unit: tuple(self._pieces[unit][0].full_shape) for unit in self._pieces
                if not is_adapter_key(unit[0])}
        for (key, index), shape in list(held.items()):  # the EP group holds every expert
            if _is_expert((key, index)):
                held.update({(key, (index[0], e)): shape for e in range(self.model.num_experts)})
        stages: list[dict] = [None] * self.mesh.pp
        dist.all_gather_object(stages, held, group=self.mesh.pp_group)
        self._check_mappable(stages)
        item = torch.empty((), dtype=dtype).element_size()
        buckets, current, largest, largest_adapted = [], None, 0, 0
        for unit in self._units_in_order():
            owners = [s for s, units in enumerate(stages) if unit in units]
            if not owners:
                raise ValueError(f"no pipeline stage holds {unit[0]} {unit[1]}, which "
                                 f"the {self._arch_name} mapping of this config needs; the model "
                                 f"and its config / architecture disagree")
            stage = owners[0]  # a tied embedding is on the first and last stage
            full_shape = stages[stage][unit]
            largest = max(largest, torch.Size(full_shape).numel()
                          * torch.empty((), dtype=train_dtype).element_size())
            rule = self._rules[unit[0]]
            shapes = rule.hf_shapes
            numel = sum(torch.Size(s).numel() for s in shapes)
            fits = (full_shape[0] >= shapes[0][0] and full_shape[1:] == shapes[0][1:]) \
                if rule.vocab else torch.Size(full_shape).numel() == numel
            if not fits:
                raise ValueError(f"{unit[0]} {unit[1]} is {full_shape} in the model but "
                                 f"the {self._arch_name} mapping expects HF tensors {shapes}; "
                                 f"the model and its config / architecture disagree")
            if current is None or current["stage"] != stage or \
                    (current["numel"] + numel) * item > bucket_bytes:
                current = {"stage": stage, "units": [], "slots": [], "numel": 0}
                buckets.append(current)
            slots = []
            for name, shape in zip(rule.hf_names(unit[1]), shapes):
                if self.lora and adapter_keys(unit[0], name, self.lora):
                    largest_adapted = max(largest_adapted, torch.Size(shape).numel())
                slots.append(Slot(name, tuple(shape), current["numel"]))
                current["numel"] += torch.Size(shape).numel()
            current["units"].append(unit)
            current["slots"].append(tuple(slots))
        train_item = torch.empty((), dtype=train_dtype).element_size()
        merge = largest_adapted * (4 + train_item)
        return BridgePlan(dtype=dtype, largest_unit_bytes=largest, merge_bytes=merge,
                          buckets=tuple(
            Bucket(stage=b["stage"], units=tuple(b["units"]), slots=tuple(b["slots"]),
                   numel=b["numel"]) for b in buckets))

    # -- streaming ------------------------------------------------------------------------

    def _assemble(self, unit: Unit) -> torch.Tensor:
        """The full per-layer Megatron tensor of `unit`: from this TP group's pieces, or an
        expert's from the EP rank holding it."""
        if not _is_expert(unit) or self.mesh.ep == 1:
            return self._gather(unit)
        per_rank = self.model.num_experts // self.mesh.ep
        owner = unit[1][1] // per_rank
        if owner == self.mesh.ep_rank:
            full = self._gather(unit).detach().contiguous()
        else:  # every expert of a key has one shape: take a local one's
            template = self._pieces[unit[0], (unit[1][0], self.mesh.ep_rank * per_rank)][0]
            full = torch.empty(template.full_shape, dtype=template.data.dtype,
                               device=template.data.device)
        dist.broadcast(full, src=dist.get_global_rank(self.mesh.ep_group, owner),
                       group=self.mesh.ep_group)
        return full

    def _gather(self, unit: Unit) -> torch.Tensor:
        """The full per-layer Megatron tensor of `unit` from this TP (expert-TP) group's
        pieces."""
        pieces = self._pieces[unit]
        group, size = self._split_group(unit)
        local = size == 1 or all(p.is_whole for p in pieces)
        in_place = _tiled_in_place(pieces) if local else None
        if in_place is not None:
            return in_place  # read the parameter itself: no copy before the split
        full = torch.empty(pieces[0].full_shape, dtype=pieces[0].data.dtype,
                           device=pieces[0].data.device)
        # Replicated pieces, and every piece at TP1, are already here.
        sharded = [i for i, p in enumerate(pieces) if not p.is_whole and size > 1]
        for i, p in enumerate(pieces):
            if i not in sharded:
                p.region(full).copy_(p.data)
        if not sharded:
            return full
        local = torch.cat([pieces[i].data.detach().reshape(-1) for i in sharded])
        gathered = torch.empty(size * local.numel(), dtype=local.dtype, device=local.device)
        dist.all_gather_into_tensor(gathered, local, group=group)
        per_rank = gathered.view(size, -1)
        for r in range(size):
            start = 0
            for i in sharded:
                shape = pieces[i].data.shape
                part = per_rank[r, start:start + shape.numel()].view(shape)
                start += shape.numel()
                piece = dataclasses.replace(pieces[i], offsets=self._peer_offsets[unit][i][r])
                piece.region(full).copy_(part)
        return full

    def _buffer(self, bucket: Bucket, reuse: bool = True) -> torch.Tensor:
        """The bucket's flat buffer. With `reuse`, a view of one buffer kept across buckets
        and syncs: a fresh allocation per bucket page-faults the whole model in again on
        every sync (half the sync time on CPU)."""
        if not reuse:
            return torch.empty(bucket.numel, dtype=self.plan.dtype)
        if self._flat is None:
            self._flat = torch.empty(max(b.numel for b in self.plan.buckets),
                                     dtype=self.plan.dtype)
        return self._flat[:bucket.numel]

    def _hf_tensors(self, bucket: Bucket) -> Iterator[tuple[Slot, torch.Tensor]]:
        """The bucket's HF tensors, on a rank of its owning stage: views of each assembled
        Megatron tensor (of the parameter itself where this rank holds it whole); with LoRA,
        an adapted projection is a new tensor W + scale * B @ A, one at a time, so no merged
        copy of the model is ever held."""
        for unit, slots in zip(bucket.units, bucket.slots):
            rule = self._rules[unit[0]]
            for slot, tensor in zip(slots, rule.split(self._assemble(unit))):
                keys = adapter_keys(unit[0], slot.name, self.lora) if self.lora else None
                if keys is not None:
                    a, b = (self._gather((key, unit[1])) for key in keys)
                    tensor = merged(tensor, a, b, self.lora)
                yield slot, tensor[: self.model.vocab_size] if rule.vocab else tensor

    def _fill(self, bucket: Bucket, reuse: bool = True) -> torch.Tensor:
        """The bucket's flat buffer, on a rank of its owning stage."""
        buffer = self._buffer(bucket, reuse)
        with torch.no_grad():
            for slot, tensor in self._hf_tensors(bucket):
                buffer[slot.offset:slot.offset + slot.numel].view(slot.shape).copy_(tensor)
        return buffer

    def stream(self, *, reuse_buffer: bool = False) -> WeightStream:
        """Colocated: every training rank gets every bucket (collective over the mesh).

        Without pipeline stages every rank owns every bucket, so the HF tensors are handed
        out as they are, with no bucket copy: views of the parameters (TP1, replicated
        tensors) or of the gathered tensor, cast when the rollout dtype differs. Consumers
        read them and must not write into them.

        With pipeline stages a bucket travels as one flat buffer. `reuse_buffer=True`
        overwrites it when the next bucket is made: for engines that copy each bucket before
        asking for the next (MegatronEngine). vLLM's loader keeps tensors of earlier buckets
        until a layer is complete, so it needs fresh buffers (the default)."""
        if self.mesh.pp == 1:
            for bucket in self.plan.buckets:
                with torch.no_grad():
                    tensors = [(slot.name, tensor.to(self.plan.dtype))
                               for slot, tensor in self._hf_tensors(bucket)]
                yield tensors
                del tensors
            return
        pp_ranks = dist.get_process_group_ranks(self.mesh.pp_group)
        for bucket in self.plan.buckets:
            if self.mesh.pp_rank == bucket.stage:
                buffer = self._fill(bucket, reuse_buffer)
            else:
                buffer = self._buffer(bucket, reuse_buffer)
            dist.broadcast(buffer, src=pp_ranks[bucket.stage], group=self.mesh.pp_group)
            yield named_views(bucket, buffer)
            del buffer

    def send(self, channel: "Channel", delta: DeltaChannel | None = None) -> None:
        """Disaggregated: DP replica 0 (its CP rank 0) sends every bucket over `channel` (see
        `open_channel`), whole or, with `delta` (this sender's side of it), as the elements
        that changed since the last sync; its other TP ranks only help assemble. Other DP
        replicas and CP ranks, which hold the same weights, return at once, unless they hold
        experts (EP > 1): then they take part in assembling too."""
        replica0 = self.mesh.dp_rank == 0 and self.mesh.cp_rank == 0
        if not replica0 and self.mesh.ep == 1:
            return
        sender = replica0 and self.mesh.tp_rank == 0
        if sender:  # every channel member takes part in every broadcast
            channel.broadcast_object(self.plan, root=0)
        for index, bucket in enumerate(self.plan.buckets):
            buffer = self._fill(bucket) if self.mesh.pp_rank == bucket.stage else None
            if not sender:
                continue
            if delta is not None:  # a sender of another stage takes part with None
                delta.exchange(index, bucket.numel, self.plan.dtype, bucket.stage, buffer)
            else:
                channel.broadcast(self._buffer(bucket) if buffer is None else buffer,
                                  root=bucket.stage)


def _is_expert(unit: Unit) -> bool:
    """Whether `unit` is one expert's tensor (indexed by layer and expert)."""
    return len(unit[1]) == 2


def _tiled_in_place(pieces: list[Piece]) -> torch.Tensor | None:
    """The full tensor as a view of one parameter, when the pieces are all its parts laid out
    as in the full tensor (a whole parameter; TP1's fused gate/up, two halves of one
    parameter); None otherwise."""
    first = pieces[0].data.detach()
    storage = first.untyped_storage().data_ptr()
    if any(p.data.untyped_storage().data_ptr() != storage for p in pieces):
        return None
    shape = pieces[0].full_shape
    strides = [1] * len(shape)
    for dim in range(len(shape) - 2, -1, -1):
        strides[dim] = strides[dim + 1] * shape[dim + 1]
    start = min(p.data.storage_offset() for p in pieces)
    full = first.as_strided(shape, strides, start)
    covered = sum(p.data.numel() for p in pieces) == full.numel()
    for p in pieces:
        region = p.region(full)
        if (region.data_ptr(), region.stride()) != (p.data.data_ptr(), p.data.stride()):
            return None
    return full if covered else None


def named_views(bucket: Bucket, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    return [(s.name, buffer[s.offset:s.offset + s.numel].view(s.shape))
            for slots in bucket.slots for s in slots]


def receive(channel: "Channel", delta: DeltaChannel | None = None
            ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Disaggregated: the engine side of `WeightBridge.send` (a WeightStream); with `delta`
    (this engine process's side of it), each bucket is the one it kept, patched."""
    plan: BridgePlan = channel.broadcast_object(None, root=0)
    for index, bucket in enumerate(plan.buckets):
        if delta is not None:
            buffer = delta.exchange(index, bucket.numel, plan.dtype, bucket.stage)
        else:
            buffer = torch.empty(bucket.numel, dtype=plan.dtype)
            channel.broadcast(buffer, root=bucket.stage)
        yield named_views(bucket, buffer)
        del buffer


class Channel:
    """A process group of its own between the training senders (channel ranks 0..PP-1, one
    per stage: TP rank 0 of DP replica 0) and the engine processes (ranks PP..): it lives
    outside the training job's default group, so trainer and engines can be separate jobs."""

    def __init__(self, group: dist.ProcessGroup, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size

    def broadcast(self, tensor: torch.Tensor, root: int) -> None:
        self.group.broadcast(tensor, root).wait()

    def all_reduce_min(self, tensor: torch.Tensor) -> None:
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.MIN
        self.group.allreduce([tensor], options).wait()

    def broadcast_object(self, obj, root: int):
        payload = pickle.dumps(obj) if self.rank == root else b""
        length = torch.tensor([len(payload)], dtype=torch.int64)
        self.broadcast(length, root)
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload \
            else torch.empty(int(length), dtype=torch.uint8)
        self.broadcast(data, root)
        return obj if self.rank == root else pickle.loads(data.numpy().tobytes())


def open_channel(host: str, port: int, rank: int, size: int, *,
                 timeout_s: float = 300.0) -> Channel:
    """Join the channel (all `size` members call this). Gloo: CPU tensors; on GPU clusters
    the same protocol would run over an NCCL group."""
    import datetime

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, size, is_master=rank == 0, timeout=timeout)
    group = dist.ProcessGroupGloo(dist.PrefixStore("megarlhf-bridge", store), rank, size, timeout)
    channel = Channel(group, rank, size)
    channel._store = store  # the group needs its store alive
    return channel
