"""The data file of a torch_dist checkpoint, written by us; DCP plans it and writes its metadata.

DCP's FileSystemWriter `torch.save`s every chunk into the rank's file, and torch computes each
record's zip CRC32 before writing its bytes, on one core. Here a chunk's archive is still
torch.save's own: its small records and directory come from `torch.save` under `skip_data`,
which leaves a hole where the tensor's bytes go. We write the bytes into the hole while a
second thread computes their CRC32 (zlib releases the GIL), then put the CRC32 where torch
would have: the record's data descriptor and its central-directory entry (torch's writer sets
general-purpose bit 3, so the local header carries none). The archive equals torch.save's
byte for byte except for the random serialization id torch gives every save.

The bytes can come as row blocks (`RowBlocks`), e.g. views of an HF file's pages in Megatron's
row order, and are written block after block: a chunk is never assembled in memory. Readers
find a chunk's bytes (and their CRC32) in its archive with `data_record`, within an
`ArchiveWindow` (megarlhf/integrity.py, where every reader's checks live).
"""

from __future__ import annotations

import dataclasses
import io
import math
import os
import struct
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import DEFAULT_SUFFIX, _StorageInfo
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from megarlhf.convert.safetensors_io import tensor_bytes
from megarlhf.integrity import ReadOnlyFile, is_storage, record_start

_DESCRIPTOR = b"PK\x07\x08"
_DATA_RECORD = "/data/0"  # torch.save names a tensor's only storage data/0
_MAX_WRITE = 1 << 30  # one pwrite at most; Linux writes at most ~2 GiB per call


def _layout_changed(what: str) -> RuntimeError:
    return RuntimeError(f"{what}: this torch ({torch.__version__}) lays out torch.save archives "
                        f"differently from the torch this writer was built against (2.13); "
                        f"convert with that torch, or teach chunk_file.py the new layout")


class ChunkFileWriter(dcp.FileSystemWriter):
    """One data file for all chunks (single_file_per_rank), written in plan order: byte
    objects first, then tensors, each asked of the planner just before it is written.
    `finish` (the metadata file) is DCP's."""

    def __init__(self, path: str):
        super().__init__(path, single_file_per_rank=True, sync_files=True, thread_count=1)

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        name = f"{plan.storage_data.prefix}0{DEFAULT_SUFFIX}"
        items = sorted(plan.items, key=lambda item: item.type != WriteItemType.BYTE_IO)
        results = []
        fd = os.open(os.path.join(self.path, name), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="crc32") as crc_thread:
                offset = 0
                for item in items:
                    data = planner.resolve_data(item)
                    if item.type == WriteItemType.BYTE_IO:
                        length = _pwrite_all(fd, data.getbuffer(), offset)
                    else:
                        length = write_tensor_archive(fd, offset, data, crc_thread)
                    del data  # freed before the next chunk is read
                    results.append(WriteResult(index=item.index, size_in_bytes=length,
                                               storage_data=_StorageInfo(name, offset, length)))
                    offset += length
            os.fsync(fd)
        finally:
            os.close(fd)
        done: Future[list[WriteResult]] = Future()
        done.set_result(results)
        return done


@dataclasses.dataclass(frozen=True)
class RowBlocks:
    """A tensor of `shape` whose bytes are those of `blocks` one after another (row blocks,
    e.g. the query, key and value heads of each KV group of a fused QKV matrix): written
    without being assembled in memory."""

    blocks: tuple[torch.Tensor, ...]
    shape: tuple[int, ...]


def write_tensor_archive(fd: int, offset: int, data: torch.Tensor | RowBlocks,
                         crc_thread: ThreadPoolExecutor) -> int:
    """Write the archive `torch.save` writes for `data` (as one contiguous tensor) at `offset`
    of the open file; returns its length."""
    if isinstance(data, torch.Tensor):
        data = RowBlocks((data,), tuple(data.shape))
    blocks = [b if b.is_contiguous() else b.contiguous() for b in data.blocks]
    dtype = blocks[0].dtype
    nbytes = math.prod(data.shape) * dtype.itemsize
    if any(b.dtype != dtype for b in blocks) or sum(b.nbytes for b in blocks) != nbytes:
        raise ValueError(f"row blocks {[(b.dtype, tuple(b.shape)) for b in blocks]} do not "
                         f"make a tensor of shape {data.shape}")
    if nbytes == 0:  # nothing to skip: torch.save's archive as it is
        archive = io.BytesIO()
        torch.save(torch.empty(data.shape, dtype=dtype), archive)
        return _pwrite_all(fd, archive.getbuffer(), offset)
    skeleton = _Skeleton()
    with torch.serialization.skip_data():
        torch.save(_placeholder(blocks, data.shape), skeleton)
    head, hole, tail = skeleton.parts(nbytes)
    views = [memoryview(tensor_bytes(b)).cast("B") for b in blocks]  # valid until we return
    crc = crc_thread.submit(_crc32, views)
    position = offset + _pwrite_all(fd, head, offset)
    for view in views:
        position += _pwrite_all(fd, view, position)
    for field in _crc_positions(head, hole, tail):
        struct.pack_into("<I", tail, field - len(head) - hole, crc.result())
    _pwrite_all(fd, tail, position)
    return len(head) + hole + len(tail)


def _placeholder(blocks: list[torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of the chunk's shape and dtype owning exactly its memory, for torch.save to
    describe (`skip_data` never reads it): the only block itself when it is one, else memory
    allocated and never touched (so never paged in)."""
    only = blocks[0]
    if len(blocks) == 1 and only.untyped_storage().nbytes() == only.nbytes:
        return only.view(shape)
    return torch.empty(shape, dtype=only.dtype)


def _crc32(views: list[memoryview]) -> int:
    crc = 0
    for view in views:
        crc = zlib.crc32(view, crc)
    return crc


class _Skeleton(io.RawIOBase):
    """A file that keeps what torch.save writes and notes the hole `skip_data` seeks over."""

    def __init__(self):
        super().__init__()
        self._pos, self._pieces, self._holes = 0, [], []

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        target = pos if whence == os.SEEK_SET else self._pos + pos
        if whence not in (os.SEEK_SET, os.SEEK_CUR) or target < self._pos:
            raise _layout_changed("torch.save seeks back or from the end while writing")
        if target > self._pos:
            self._holes.append((self._pos, target))
        self._pos = target
        return self._pos

    def write(self, b) -> int:
        b = bytes(b)
        self._pieces.append((self._pos, b))
        self._pos += len(b)
        return len(b)

    def parts(self, nbytes: int) -> tuple[bytes, int, bytearray]:
        """(bytes before the hole, hole length, bytes after it)."""
        if len(self._holes) != 1 or self._holes[0][1] - self._holes[0][0] != nbytes:
            raise _layout_changed(f"torch.save left holes {self._holes}, expected one of "
                                  f"{nbytes} bytes")
        start, end = self._holes[0]
        head, tail = bytearray(), bytearray()
        for pos, piece in self._pieces:
            part = head if pos < start else tail
            if pos != (len(head) if pos < start else end + len(tail)):
                raise _layout_changed("torch.save's archive is not contiguous around the hole")
            part += piece
        return bytes(head), end - start, tail


def _crc_positions(head: bytes, hole: int, tail: bytearray) -> list[int]:
    """Archive offsets of the data record's two CRC32 fields: in the data descriptor right
    after the bytes and in the record's central-directory entry."""
    archive = _SparseArchive(head, hole, tail)
    with zipfile.ZipFile(archive) as zf:
        infos = zf.infolist()
        entry = zf.start_dir
        for info in infos:
            if info.filename.endswith(_DATA_RECORD):
                break
            entry += 46 + len(info.orig_filename.encode()) + len(info.extra) + len(info.comment)
        else:
            raise _layout_changed("torch.save's archive has no data/0 record")
    descriptor = len(head) + hole
    if not info.flag_bits & 0x08 or tail[:4] != _DESCRIPTOR or \
            tail[entry - descriptor:entry - descriptor + 4] != b"PK\x01\x02":
        raise _layout_changed("torch.save's data record is not followed by a data "
                              "descriptor with its CRC32, and one in the directory")
    return [descriptor + 4, entry + 16]


def data_record(archive: io.RawIOBase, nbytes: int, key: str) -> tuple[int, int]:
    """(where the bytes of a torch.save archive's only storage (data/0, stored uncompressed)
    begin within the archive, the CRC32 its directory records for them)."""
    with zipfile.ZipFile(archive) as zf:
        records = [i for i in zf.infolist() if is_storage(i)]
    if len(records) != 1 or records[0].compress_type != zipfile.ZIP_STORED \
            or records[0].file_size != nbytes:
        raise ValueError(f"chunk {key!r} is not one uncompressed tensor storage of {nbytes} "
                         f"bytes: {[(i.filename, i.file_size) for i in records]}; was the "
                         f"checkpoint saved in Megatron's torch_dist format?")
    return record_start(archive, records[0]), records[0].CRC


class _SparseArchive(ReadOnlyFile):
    """head + `hole` zero bytes + tail, readable without the hole in memory (zipfile reads
    only the directory in the tail)."""

    def __init__(self, head: bytes, hole: int, tail: bytes):
        super().__init__(len(head) + hole + len(tail))
        self._head, self._hole, self._tail = head, hole, tail

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        n, got = min(len(view), self._size - self._pos), 0
        tail_start = len(self._head) + self._hole
        while got < n:
            pos, want = self._pos + got, n - got
            if pos < len(self._head):
                part = self._head[pos:pos + want]
            elif pos < tail_start:
                part = bytes(min(tail_start - pos, want))
            else:
                part = self._tail[pos - tail_start:pos - tail_start + want]
            view[got:got + len(part)] = part
            got += len(part)
        self._pos += n
        return n


def _pwrite_all(fd: int, data, offset: int) -> int:
    view = memoryview(data).cast("B")
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:done + _MAX_WRITE], offset + done)
    return len(view)
