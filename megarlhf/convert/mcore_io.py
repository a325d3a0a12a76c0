"""Streaming reads and writes of Megatron dist checkpoints (torch_dist format) in one process.

A Megatron checkpoint is layout-free: each tensor is stored under its global key, layers
stacked on a leading axis, in chunks with global offsets. Megatron's own `sharded_state_dict`
of a meta-device model at TP1/PP1 tells which keys, shapes and chunks a full checkpoint has;
the writer below plans exactly those chunks with DCP, which also writes the metadata, and
writes the data file itself (`chunk_file.ChunkFileWriter`), asking for each chunk's data just
before writing it and dropping it after, so at most one chunk (one layer's matrix) is in
memory. The reader fetches arbitrary slabs (e.g. one layer of one key) of a checkpoint
written at any layout, loading each stored chunk once and copying only to assemble a slab from
several chunks.
"""

from __future__ import annotations

import contextlib
import io
import math
import os
import zipfile
from concurrent.futures import Future, ThreadPoolExecutor
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
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from megarlhf.convert.chunk_file import ChunkFileWriter, RowBlocks, data_record
from megarlhf.convert.pages import map_tensor
from megarlhf.errors import CorruptFileError
from megarlhf.integrity import ArchiveWindow, check_archive, check_crc, check_extent, read_metadata
from megarlhf.models.config import ModelConfig
from megarlhf.models.gpt import build_model, model_spec
from megarlhf.parallel.mesh import DistEnv, ParallelConfig, destroy_mesh, free_port, init_mesh

# Resolves one chunk: (checkpoint key, (layer[, expert]) index or (), the key's per-layer shape)
# -> the whole per-layer tensor as row blocks (tensors whose concatenation along dim 0 is the
# tensor: one block, HF's gate and up projections for the fused MLP, or the query, key and
# value heads of each KV group for the fused QKV); the writer cuts each chunk out of them and
# writes the parts it covers one after another, with no copy.
TensorSource = Callable[[str, tuple[int, ...], tuple[int, ...]], list[torch.Tensor]]


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


def _narrow(tensor: torch.Tensor, offsets, lengths) -> torch.Tensor:
    for dim, (offset, length) in enumerate(zip(offsets, lengths)):
        tensor = tensor.narrow(dim, offset, length)
    return tensor


class _StreamingSavePlanner(DefaultSavePlanner):
    """Plans the given write items and produces each tensor only when it is written:
    `ChunkFileWriter` asks for a chunk just before writing it and drops it after, so one
    chunk (and the source's blocks of its key) is in memory at a time."""

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


class _Chunks:
    """Each planned chunk, cut out of the row blocks that `source` gives for its key.

    Chunks of one key and index (e.g. gate and up of the fused MLP) come one after another,
    so the last key's blocks are kept rather than rebuilt per chunk."""

    def __init__(self, by_index: dict[MetadataIndex, ShardedTensor], source: TensorSource):
        self._by_index, self._source = by_index, source
        self._id, self._blocks = None, []

    def __call__(self, item: WriteItem) -> RowBlocks:
        sh = self._by_index[item.index]
        prepend = sh.prepend_axis_num
        index = tuple(sh.global_offset[:prepend])  # (layer,) or (layer, expert)
        if (sh.key, index) != self._id:
            self._blocks, first = [], 0  # the last key's blocks freed before the next are read
            self._id = (sh.key, index)
            for block in self._source(sh.key, index, tuple(sh.global_shape[prepend:])):
                if block.dtype != sh.dtype:
                    raise ValueError(f"{sh.key}: source tensor is {block.dtype}, checkpoint "
                                     f"is {sh.dtype}")
                self._blocks.append((first, block))
                first += block.shape[0]
        offsets, shape = sh.global_offset[prepend:], tuple(sh.local_shape)
        return RowBlocks(self._cut(offsets, shape), tuple(item.tensor_data.chunk.sizes))

    def _cut(self, offsets, shape) -> tuple[torch.Tensor, ...]:
        """The parts of the blocks that the chunk at `offsets` of `shape` covers, in order:
        views, so nothing is copied unless the chunk takes some of a block's columns."""
        rows, parts = (offsets[0], offsets[0] + shape[0]), []
        for first, block in self._blocks:
            start, end = max(rows[0], first), min(rows[1], first + block.shape[0])
            if start < end:
                parts.append(_narrow(block.narrow(0, start - first, end - start),
                                     (0, *offsets[1:]), (end - start, *shape[1:])))
        if sum(p.shape[0] for p in parts) != shape[0]:
            raise ValueError(f"the source's row blocks do not cover rows {rows} of the chunk")
        return tuple(parts)


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
    # Whole tensors first. The embedding and output layer are the largest; written before any
    # layer, they do not come on top of what glibc keeps in its heap of the freed per-layer
    # tensors (blocks under its mmap threshold, at most 32 MiB; that heap levels off at about
    # two layers' worth).
    stacked = {index for index, sh in by_index.items() if sh.prepend_axis_num}
    items.sort(key=lambda item: item.index in stacked)

    writer = ChunkFileWriter(path)
    planner = _StreamingSavePlanner(items, _Chunks(by_index, source), objects)
    dcp.save({}, storage_writer=writer, planner=planner, no_dist=True)
    # The files Megatron's loader expects next to the torch_dist data.
    save_config(CheckpointingConfig("torch_dist", 1), path)  # 0.19 dropped the rest
    torch.save({}, os.path.join(path, "common.pt"))


class CheckpointReader:
    """Slabs of a Megatron dist checkpoint written at any layout.

    Reads the stored chunks itself rather than through `dcp.load`, which copies every chunk
    it loads into a destination given up front: a slab that is exactly one stored chunk (a
    layer of a checkpoint written at TP1) is the loaded chunk itself, and the only copies are
    those assembling a slab from several chunks."""

    def __init__(self, path: str):
        self.path = path
        self.sources = [path]
        """The checkpoint directories it reads."""
        self.metadata = read_metadata(path)
        self._verified: set[MetadataIndex] = set()  # chunks whose CRC32 was checked
        self._checker: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []

    @contextlib.contextmanager
    def background_checks(self):
        """Inside, the CRC32 checks run in a thread beside the caller's work (zlib releases
        the GIL), instead of before each read returns; a read raises the failure of any check
        done by then, and leaving waits for the rest. For callers that publish nothing of what
        they read before leaving."""
        self._checker = ThreadPoolExecutor(1)
        try:
            yield self
            for check in self._pending:
                check.result()
        finally:
            self._checker.shutdown(wait=True, cancel_futures=True)
            self._checker, self._pending = None, []

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
        return [self._slab(*request) for request in requests]

    def _slab(self, key: str, offsets, sizes) -> torch.Tensor:
        sizes = tuple(sizes)
        items = create_read_items_for_chunk_list(
            key, self.metadata.state_dict_metadata[key],
            [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))])
        if sum(math.prod(item.lengths) for item in items) != math.prod(sizes):
            raise ValueError(f"{self.path}: the stored chunks of {key!r} do not cover "
                             f"{sizes} at {tuple(offsets)}")
        if len(items) == 1:  # within one stored chunk: no assembly
            chunk = self._chunk(items[0].storage_index)
            slab = _narrow(chunk, items[0].storage_offsets, sizes)
            return chunk if slab.shape == chunk.shape else slab.clone()
        out = torch.empty(sizes, dtype=self.dtype(key))
        for item in items:
            chunk = self._chunk(item.storage_index)
            _narrow(out, item.dest_offsets, item.lengths).copy_(
                _narrow(chunk, item.storage_offsets, item.lengths))
        return out

    def _chunk(self, index: MetadataIndex) -> torch.Tensor:
        """A stored chunk over the file's pages (`pages.map_tensor`), not read into fresh
        memory. FileSystemWriter's layout: each chunk torch.save'd at (offset, length) of its
        file; torch.load under `skip_data` gives the tensor's shape, strides and storage
        without reading its bytes, which are the archive's stored data/0 record."""
        info = self.metadata.storage_data[index]
        if getattr(info, "transform_descriptors", None):
            raise ValueError(f"{self.path}: {index.fqn} is stored with transforms "
                             f"{info.transform_descriptors}, which this reader does not undo")
        file, what = os.path.join(self.path, info.relative_path), f"tensor {index.fqn!r}"
        check_extent(file, info.offset + info.length)
        first_read = index not in self._verified  # a chunk read per layer is checked once
        self._verified.add(index)
        with open(file, "rb") as f:
            archive = ArchiveWindow(f, info.offset, info.length)
            # The small records before torch.load trusts them; the tensor's bytes below.
            crc_recorded = first_read and check_archive(archive, file, what, storages=False)
            archive.seek(0)  # torch.load reads from where the check left off
            try:
                with torch.serialization.skip_data():
                    layout = torch.load(archive, map_location="cpu", weights_only=True)
            except (RuntimeError, ValueError, zipfile.BadZipFile, EOFError) as e:
                raise CorruptFileError(f"{file}: the archive of {what} cannot be read ({e}): "
                                       f"the file is corrupt; restore it or use another "
                                       f"checkpoint") from None
            storage_bytes = layout.untyped_storage().nbytes()
            start, crc = data_record(archive, storage_bytes, index.fqn)
            flat = map_tensor(f, info.offset + start, storage_bytes // layout.element_size(),
                              layout.dtype)
        if crc_recorded:
            self._check(file, what, flat, crc)
        return flat.as_strided(layout.shape, layout.stride(), layout.storage_offset())

    def _check(self, file: str, what: str, data: torch.Tensor, crc: int) -> None:
        """`check_crc` now, or in the background thread; there, a failure already found is
        raised now rather than after the rest of the export."""
        if self._checker is None:
            check_crc(file, what, data, crc)
            return
        pending = []
        for check in self._pending:
            if check.done():
                check.result()
            else:
                pending.append(check)
        self._pending = pending + [self._checker.submit(check_crc, file, what, data, crc)]


class LayeredReader:
    """An adapter-only checkpoint's tensors over those of its base: a key the top checkpoint
    holds (an adapter, a value head) is read from it, every other from the base."""

    def __init__(self, top: CheckpointReader, base: CheckpointReader):
        self.top, self.base, self.path = top, base, top.path
        self.sources = top.sources + base.sources
        self.metadata = top.metadata

    @contextlib.contextmanager
    def background_checks(self):
        with self.top.background_checks(), self.base.background_checks():
            yield self

    def _holder(self, key: str) -> CheckpointReader:
        return self.top if self.top.shape(key) is not None else self.base

    def shape(self, key: str) -> tuple[int, ...] | None:
        return self._holder(key).shape(key)

    def read(self, requests: list[tuple[str, tuple[int, ...], tuple[int, ...]]]
             ) -> list[torch.Tensor]:
        """As CheckpointReader.read, each request from the checkpoint that holds its key."""
        return [self._holder(request[0]).read([request])[0] for request in requests]
