"""Checkpoint files checked when they are read back: present, as long as the metadata says,
and every record of every torch.save archive in them matching the CRC32 its zip directory
records.

A dist checkpoint's data files hold one torch.save archive (a zip) per stored tensor chunk or
object, at the (offset, length) DCP's `.metadata` gives; `common.pt` is one more. torch's zip
reader is built without its CRC32 checks and DCP adds none, and our converters read tensor
bytes through mapped pages: without these checks a flipped byte loads as a wrong weight and a
truncated file fails with a zip error deep in a rank. `.metadata`, `metadata.json` and
`megarlhf_complete.json` (pickle, JSON) carry no checksum: damage there is caught where it
leaves them unreadable. `ArchiveWindow` and `record_start` find an archive and its records in
a data file, for these checks and for the converters' reader (convert/mcore_io.py).

`file_sha256` checks the other files we write and read back: a prompt cache
(data/prompts.py), a PPO checkpoint's pending rollout (ppo/checkpoints.py).

Below data/, engine/ and convert/, which all read what it checks: it imports none of them.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import struct
import zipfile
import zlib

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from megarlhf.errors import CorruptFileError, describe

COMMON_STATE = "common.pt"  # megatron-core's non-sharded state, loaded by every rank
COMMON_OBJECT = "common_state"  # where megatron-core 0.17 and later store it instead
MCORE_CONFIG = "metadata.json"  # megatron-core's description of the checkpoint's format
# Read and checked in pieces that stay in the CPU cache: ~2.7x faster than zipfile's reads.
_BLOCK = 1 << 20
_FIX = "the file is corrupt; restore it or use another checkpoint"
_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., name length, extra field length


def file_sha256(path: str) -> str:
    """The hex SHA-256 of a file we wrote and recorded the checksum of."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


WEIGHT_SAMPLE = 1 << 20
"""The bytes `sample_weights` reads from each end of a weights file."""


def sample_weights(digest, file: str, start: int = 0) -> None:
    """Add to `digest` the first and last MiB of the weights file `file`'s data (from
    `start`, past a header the caller added itself). Hashing every weight of a 70B model at
    each launch would take minutes; another training of the same model differs in those
    sampled bytes too (every tensor moves)."""
    with open(file, "rb") as f:
        f.seek(start)
        digest.update(f.read(WEIGHT_SAMPLE))
        f.seek(max(f.tell(), os.fstat(f.fileno()).st_size - WEIGHT_SAMPLE))
        digest.update(f.read())


CHUNK_SAMPLE = 4096
"""The bytes `checkpoint_weights_fingerprint` reads from the start of each stored chunk."""


def checkpoint_weights_fingerprint(path: str) -> str:
    """A dist checkpoint at `path` by its weights: DCP's index of them (keys, shapes, dtypes,
    and which file, offset and length holds each chunk), and the first CHUNK_SAMPLE bytes of
    every chunk (a few MB for a 70B model, every tensor sampled). The same for a moved or
    copied checkpoint and for the same weights converted again at the same layout (the
    `.metadata` file's own bytes would not be: each save writes a new id into it); another
    for one trained further."""
    metadata = read_metadata(path)
    digest = hashlib.sha256()
    for key in sorted(metadata.state_dict_metadata):
        digest.update(f"{key}\0{metadata.state_dict_metadata[key]!r}\0".encode())
    chunks = sorted(metadata.storage_data.items(),
                    key=lambda item: (item[0].fqn, tuple(item[0].offset or ()),
                                      item[0].index or 0))
    files = {}
    try:
        for index, where in chunks:
            digest.update(f"{index.fqn}\0{tuple(index.offset or ())}\0{where.relative_path}"
                          f"\0{where.offset}\0{where.length}\0".encode())
            if where.relative_path not in files:
                files[where.relative_path] = open(os.path.join(path, where.relative_path), "rb")
            f = files[where.relative_path]
            f.seek(where.offset)
            digest.update(f.read(min(where.length, CHUNK_SAMPLE)))
    finally:
        for f in files.values():
            f.close()
    return digest.hexdigest()


def read_metadata(path: str) -> Metadata:
    """DCP's `.metadata` of the checkpoint at `path`; CorruptFileError if it cannot be read."""
    file = os.path.join(path, ".metadata")
    if not os.path.isfile(file):
        raise CorruptFileError(f"{file} is missing: {path} is not a complete dist checkpoint")
    try:
        return dcp.FileSystemReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 - unpickling a damaged file raises anything
        raise CorruptFileError(f"{file} cannot be read ({type(e).__name__}: {e}): the "
                               f"checkpoint is corrupt; restore it or use another") from None


def read_json(file: str) -> dict:
    """The JSON object in `file`; CorruptFileError if it is missing or is not one."""
    try:
        with open(file) as f:
            content = json.load(f)
    except FileNotFoundError:
        raise CorruptFileError(f"{file} is missing: the checkpoint is incomplete; restore it "
                               f"or use another checkpoint") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptFileError(f"{file} cannot be read ({e}): {_FIX}") from None
    if not isinstance(content, dict):
        raise CorruptFileError(f"{file} holds no JSON object: {_FIX}")
    return content


def check_extent(file: str, end: int) -> None:
    """CorruptFileError unless `file` exists and holds at least `end` bytes."""
    if not os.path.isfile(file):
        raise CorruptFileError(f"{file} is missing: the checkpoint is incomplete; restore it "
                               f"or use another checkpoint")
    size = os.path.getsize(file)
    if size < end:
        raise CorruptFileError(f"{file} is truncated: {size} bytes, the checkpoint's metadata "
                               f"needs at least {end}; restore it or use another checkpoint")


def check_archive(archive: io.RawIOBase, file: str, what: str, *, storages: bool = True
                  ) -> bool:
    """Check the torch.save archive `archive` (a window of `file` holding `what`, e.g.
    "tensor 'k'"): every record's local header, and the CRC32 of every record, or with
    `storages=False` only of those that are not a storage's bytes (torch.load reads data.pkl
    and the like unchecked; the converter checks the bytes over its mapped pages).

    Returns False, having checked no CRC32, for an archive saved with torch's CRC32s off
    (torch.serialization.set_crc32_options(False) records 0 for every record)."""
    try:
        with zipfile.ZipFile(archive) as zf:
            records = zf.infolist()
        starts = [record_start(archive, record) for record in records]
    except (zipfile.BadZipFile, EOFError, ValueError) as e:
        raise CorruptFileError(f"{file}: the archive of {what} cannot be read ({e}): "
                               f"{_FIX}") from None
    if not any(record.CRC for record in records):
        return False
    buffer = memoryview(bytearray(_BLOCK))
    for record, start in zip(records, starts):
        if storages or not is_storage(record):
            actual = _crc32(archive, start, record.compress_size, buffer)
            if actual != record.CRC:
                raise CorruptFileError(_crc_message(file, _subject(what, record), record.CRC,
                                                    actual))
    return True


def check_crc(file: str, what: str, data: torch.Tensor, stored: int) -> None:
    """CorruptFileError unless the bytes of `data` (the storage of `what`, as read) have
    CRC32 `stored`."""
    actual = zlib.crc32(data.reshape(-1).view(torch.uint8).numpy())
    if actual != stored:
        raise CorruptFileError(_crc_message(file, what, stored, actual))


def verify_checkpoint(path: str, keys: set[str] | None = None, *, part: int = 0,
                      parts: int = 1) -> None:
    """Check the checkpoint's stored archives of `keys` (every one if None): the data files
    holding them there and long enough, then every record of every `parts`-th archive from
    `part` on; with part 0 also megatron-core's own files (`metadata.json`, `common.pt`).
    The common state is read by every load: `common.pt` (megatron-core 0.16, our
    converters) or the object COMMON_OBJECT among the archives (0.17 and later).
    CorruptFileError naming the first damaged file."""
    metadata = read_metadata(path)
    in_archives = any(_key(index.fqn, metadata) == COMMON_OBJECT
                      for index in metadata.storage_data)
    wanted = None if keys is None else keys | {COMMON_OBJECT}
    items = sorted(((index, info) for index, info in metadata.storage_data.items()
                    if wanted is None or _key(index.fqn, metadata) in wanted),
                   key=lambda item: (item[1].relative_path, item[1].offset))
    ends: dict[str, int] = {}
    for _, info in items:
        ends[info.relative_path] = max(ends.get(info.relative_path, 0),
                                       info.offset + info.length)
    for name, end in sorted(ends.items()):
        check_extent(os.path.join(path, name), end)
    if part == 0:
        read_json(os.path.join(path, MCORE_CONFIG))
        common = os.path.join(path, COMMON_STATE)
        if os.path.exists(common) or not in_archives:  # megatron-core prefers the file
            check_extent(common, 0)
            _check_file(common, "the common state", 0, os.path.getsize(common))
    for index, info in items[part::parts]:
        stored = metadata.state_dict_metadata.get(index.fqn)
        kind = "object" if isinstance(stored, BytesStorageMetadata) else "tensor"
        _check_file(os.path.join(path, info.relative_path), f"{kind} {index.fqn!r}",
                    info.offset, info.length)


def verify_checkpoint_collectively(path: str, keys: set[str]) -> None:
    """`verify_checkpoint` of what a load of `keys` reads on any rank of the default process
    group, split over those ranks; every rank raises the first failure any rank found (none
    is left waiting in the load).

    Only the keys loaded are checked (a model-only load of a checkpoint with optimizer state
    reads a fraction of it), and each of their archives by one rank, round-robin in file
    order: the load reads and checks them once in total at any layout, where checking what
    each rank loads would check a tensor once per data-parallel replica. The load that
    follows reads the bytes again, from the page cache on the node that checked them.
    Measured: 0.36 s per GiB of archives on one core, the file in the page cache
    (zlib.crc32 alone: 0.34 s)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        verify_checkpoint(path, keys)
        return
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, sorted(keys))
    try:
        verify_checkpoint(path, set().union(*every_rank), part=dist.get_rank(),
                          parts=dist.get_world_size())
        problem = None
    except (CorruptFileError, OSError) as e:  # OSError: a file this rank cannot read
        problem = (isinstance(e, CorruptFileError), describe(e))
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    found = [p for p in problems if p is not None]
    if found:
        corrupt, message = found[0]
        raise (CorruptFileError if corrupt else ValueError)(message)


def is_storage(record: zipfile.ZipInfo) -> bool:
    """Whether a torch.save archive's record holds a storage's bytes (data/<n>), not a small
    record that describes them (data.pkl, byteorder, version, ...)."""
    return "/data/" in record.filename


def record_start(archive: io.RawIOBase, record: zipfile.ZipInfo) -> int:
    """Where the bytes of `record` begin within the archive: after its local header (which
    zipfile's directory listing does not read). BadZipFile unless a header is there naming
    the record as the directory does (torch looks records up by the directory's names)."""
    archive.seek(record.header_offset)
    header = archive.read(_LOCAL_HEADER.size)
    if len(header) < _LOCAL_HEADER.size or not header.startswith(b"PK\x03\x04"):
        raise zipfile.BadZipFile(f"record {record.filename!r} has no local header at byte "
                                 f"{record.header_offset}")
    _, name_length, extra_length = _LOCAL_HEADER.unpack(header)
    name = archive.read(name_length)
    if name != record.orig_filename.encode("utf-8" if record.flag_bits & 0x800 else "cp437"):
        raise zipfile.BadZipFile(f"the directory's record {record.filename!r} is named "
                                 f"{name.decode('cp437')!r} in its local header")
    return record.header_offset + _LOCAL_HEADER.size + name_length + extra_length


class ReadOnlyFile(io.RawIOBase):
    """A read-only file of `size` bytes; subclasses read from position `_pos`."""

    def __init__(self, size: int):
        super().__init__()
        self._size, self._pos = size, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._size}[whence]
        self._pos = min(max(base + pos, 0), self._size)
        return self._pos


class ArchiveWindow(ReadOnlyFile):
    """Bytes [offset, offset + length) of an open file as a file of their own: the
    torch.save archive of one chunk, among the many back to back in a torch_dist file."""

    def __init__(self, file, offset: int, length: int):
        super().__init__(length)
        self._file, self._offset = file, offset

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")[:max(0, self._size - self._pos)]
        self._file.seek(self._offset + self._pos)
        n = self._file.readinto(view)
        self._pos += n
        return n


def _key(fqn: str, metadata: Metadata) -> str:
    """The checkpoint key a stored item belongs to: megatron-core stores an object under
    '<key>/shard_<offset>_<shape>'."""
    if isinstance(metadata.state_dict_metadata.get(fqn), BytesStorageMetadata):
        return fqn.rsplit("/shard_", 1)[0]
    return fqn


def _check_file(file: str, what: str, offset: int, length: int) -> None:
    with open(file, "rb") as f:
        check_archive(ArchiveWindow(f, offset, length), file, what)


def _crc32(archive: io.RawIOBase, start: int, length: int, buffer: memoryview) -> int:
    """CRC32 of bytes [start, start + length) of the archive (fewer where it ends sooner)."""
    archive.seek(start)
    crc = 0
    while length > 0:
        n = archive.readinto(buffer[:min(length, len(buffer))])
        if n == 0:
            break
        crc = zlib.crc32(buffer[:n], crc)
        length -= n
    return crc


def _subject(what: str, record: zipfile.ZipInfo) -> str:
    return what if is_storage(record) else f"{what} (record {record.filename!r})"


def _crc_message(file: str, what: str, stored: int, actual: int) -> str:
    return (f"{file}: {what} fails its CRC32 check (stored 0x{stored:08x}, read "
            f"0x{actual:08x}): {_FIX}")
