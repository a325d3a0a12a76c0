"""Streaming reads and writes of Megatron dist checkpoints (torch_dist format) in one process.

A Megatron checkpoint is layout-free: each tensor is stored under its global key, layers
stacked on a leading axis, in chunks with global offsets. Megatron's own `sharded_state_dict`
of a meta-device model at TP1/PP1 tells which keys, shapes and chunks a full checkpoint has;
the writer below plans exactly those chunks and asks for each chunk's data only when the
storage writer reaches it, so at most one chunk (one layer's matrix) is in memory. The reader
fetches arbitrary slabs (e.g. one layer of one key) of a checkpoint written at any layout.
"""

from __future__ import annotations

import contextlib
import io
import os
import warnings
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from megatron.core.dist_checkpointing.core import CheckpointingConfig, save_config
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, apply_factories
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    LoadPlan,
    LoadPlanner,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megarlhf.models.config import ModelConfig
from megarlhf.models.gpt import build_model, model_spec
from megarlhf.parallel.mesh import DistEnv, ParallelConfig, destroy_mesh, free_port, init_mesh

# Resolves one chunk: (checkpoint key, layer index or None, the key's per-layer global shape)
# -> the whole per-layer tensor; the writer cuts the chunk out of it.
TensorSource = Callable[[str, "int | None", tuple[int, ...]], torch.Tensor]


@contextlib.contextmanager
def single_rank_mesh():
    """A one-process TP1/PP1 mesh (Megatron needs one to build even a meta model)."""
    started = not dist.is_initialized()
    if not started and dist.get_world_size() != 1:
        raise ValueError("conversion runs in one process; call it outside a multi-rank job")
    env = DistEnv(rank=0, world_size=1, local_rank=0, master_addr="127.0.0.1",
                  master_port=free_port())
    mesh = init_mesh(ParallelConfig(), env if started else None)
    try:
        yield mesh
    finally:
        if started:
            destroy_mesh()


def checkpoint_template(model: ModelConfig, *, value_head: bool, dtype: torch.dtype):
    """Megatron's description (ShardedTensors/ShardedObjects, no data) of a full checkpoint."""
    parallel = ParallelConfig()
    spec = model_spec(model, parallel, value_head=value_head, dtype=dtype, layer_spec="local",
                      on_gpu=False)
    with single_rank_mesh() as mesh:
        sharded = build_model(spec, mesh, meta=True)[0].sharded_state_dict()
        apply_factories(sharded)
    return list(nested_values(sharded))


@contextlib.contextmanager
def _single_process():
    # DCP warns that it "assumes the intent" of a single process; here that is the design.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process", category=UserWarning)
        yield


def _narrow(tensor: torch.Tensor, offsets, lengths) -> torch.Tensor:
    for dim, (offset, length) in enumerate(zip(offsets, lengths)):
        tensor = tensor.narrow(dim, offset, length)
    return tensor


class _StreamingSavePlanner(DefaultSavePlanner):
    """Plans the given write items and produces each tensor only when it is written."""

    def __init__(self, items: list[WriteItem], tensor_for: Callable[[WriteItem], torch.Tensor],
                 objects: dict[str, io.BytesIO]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._items, self._tensor_for, self._objects = items, tensor_for, objects

    def set_up_planner(self, state_dict, storage_meta=None, is_coordinator=False):
        self.state_dict, self.is_coordinator = {}, is_coordinator

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(self._items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        if write_item.type == WriteItemType.BYTE_IO:
            return self._objects[write_item.index.fqn]
        return self._tensor_for(write_item)


def write_checkpoint(path: str, template, source: TensorSource) -> None:
    """Write a Megatron dist checkpoint with the keys and chunks of `template` into the
    existing empty directory `path`, pulling tensors from `source` one chunk at a time."""
    items, objects, by_index = [], {}, {}
    for sh in template:
        if isinstance(sh, ShardedObject):
            payload = io.BytesIO()
            torch.save([sh.data], payload)  # Megatron's on-disk form of a ShardedObject
            objects[sh.unique_key] = payload
            items.append(WriteItem(index=MetadataIndex(sh.unique_key), type=WriteItemType.BYTE_IO))
            continue
        assert isinstance(sh, ShardedTensor) and sh.flattened_range is None, sh
        prepend = sh.prepend_axis_num
        chunk = ChunkStorageMetadata(offsets=torch.Size(sh.global_offset),
                                     sizes=torch.Size((1,) * prepend + tuple(sh.local_shape)))
        index = MetadataIndex(sh.key, chunk.offsets)
        items.append(WriteItem(index=index, type=WriteItemType.SHARD, tensor_data=TensorWriteData(
            chunk=chunk, properties=TensorProperties(dtype=sh.dtype),
            size=torch.Size(sh.global_shape))))
        by_index[index] = sh

    cache: dict = {}

    def tensor_for(item: WriteItem) -> torch.Tensor:
        sh = by_index[item.index]
        prepend = sh.prepend_axis_num
        layer = sh.global_offset[0] if prepend else None
        # Chunks of one key and layer (e.g. gate and up of the fused MLP) come one after
        # another; keep the last per-layer tensor rather than rebuild it per chunk.
        if cache.get("id") != (sh.key, layer):
            cache.clear()
            full = source(sh.key, layer, tuple(sh.global_shape[prepend:]))
            cache.update(id=(sh.key, layer), tensor=full)
        part = _narrow(cache["tensor"], sh.global_offset[prepend:], sh.local_shape)
        if part.dtype != sh.dtype:
            raise ValueError(f"{sh.key}: source tensor is {part.dtype}, checkpoint is {sh.dtype}")
        return part.reshape(item.tensor_data.chunk.sizes).contiguous()

    writer = dcp.FileSystemWriter(path, single_file_per_rank=True, thread_count=1)
    with _single_process():
        dcp.save({}, storage_writer=writer,
                 planner=_StreamingSavePlanner(items, tensor_for, objects), no_dist=True)
    # The files Megatron's loader expects next to the torch_dist data.
    save_config(CheckpointingConfig("torch_dist", 1, "torch", 1), path)
    torch.save({}, os.path.join(path, "common.pt"))


class _SlabLoadPlanner(LoadPlanner):
    """Reads requested (key, offsets, sizes) slabs into fresh tensors."""

    def __init__(self, requests: list[tuple[str, tuple[int, ...], tuple[int, ...]]]):
        self.requests = requests
        self.buffers: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, offsets, sizes in self.requests:
            md = self.metadata.state_dict_metadata[key]
            self.buffers[(key, tuple(offsets))] = torch.zeros(sizes, dtype=md.properties.dtype)
            items += create_read_items_for_chunk_list(
                key, md, [ChunkStorageMetadata(offsets=torch.Size(offsets),
                                               sizes=torch.Size(sizes))])
        return LoadPlan(items)

    def create_global_plan(self, global_plan):
        return global_plan

    def finish_plan(self, central_plan):
        return central_plan

    def load_bytes(self, read_item, value):
        pass

    def resolve_tensor(self, read_item):
        buf = self.buffers[(read_item.dest_index.fqn, tuple(read_item.dest_index.offset))]
        return _narrow(buf, read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item, tensor):
        pass


class CheckpointReader:
    """Slabs of a Megatron dist checkpoint written at any layout."""

    def __init__(self, path: str):
        self.path = path
        self.metadata = dcp.FileSystemReader(path).read_metadata()

    def shape(self, key: str) -> tuple[int, ...] | None:
        md = self.metadata.state_dict_metadata.get(key)
        return tuple(md.size) if md is not None and hasattr(md, "size") else None

    def dtype(self, key: str) -> torch.dtype:
        return self.metadata.state_dict_metadata[key].properties.dtype

    def read(self, requests: list[tuple[str, tuple[int, ...], tuple[int, ...]]]
             ) -> list[torch.Tensor]:
        """One tensor per (key, offsets, sizes) request, in request order."""
        for key, _, _ in requests:
            if self.shape(key) is None:
                raise ValueError(f"{self.path} has no tensor {key!r}")
        planner = _SlabLoadPlanner(requests)
        with _single_process():
            dcp.load({}, storage_reader=dcp.FileSystemReader(self.path), planner=planner,
                     no_dist=True)
        return [planner.buffers[(key, tuple(offsets))] for key, offsets, _ in requests]
