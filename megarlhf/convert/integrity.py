"""Checkpoint files checked when they are read back: present, as long as the metadata says,
and every torch.save archive in them matching the CRC32 its zip directory records.

A dist checkpoint's data files hold one torch.save archive (a zip) per stored chunk, at the
(offset, length) DCP's `.metadata` gives. torch's and DCP's loaders never check those CRC32s,
and our converters read the bytes through mapped pages: without these checks a flipped byte
loads as a wrong weight and a truncated file fails with a zip error deep in a rank.
"""

from __future__ import annotations

import os
import zipfile
import zlib

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata

from megarlhf.convert.chunk_file import ArchiveWindow
from megarlhf.errors import CorruptFileError

_BLOCK = 1 << 24


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


def check_extent(file: str, end: int) -> None:
    """CorruptFileError unless `file` exists and holds at least `end` bytes."""
    if not os.path.isfile(file):
        raise CorruptFileError(f"{file} is missing: the checkpoint's metadata lists it; "
                               f"restore it or use another checkpoint")
    size = os.path.getsize(file)
    if size < end:
        raise CorruptFileError(f"{file} is truncated: {size} bytes, the checkpoint's metadata "
                               f"needs at least {end}; restore it or use another checkpoint")


def check_crc(file: str, key: str, data: torch.Tensor, stored: int) -> None:
    """CorruptFileError unless the bytes of `data` (a chunk as read) have CRC32 `stored`."""
    actual = zlib.crc32(data.reshape(-1).view(torch.uint8).numpy())
    if actual != stored:
        raise CorruptFileError(_crc_message(file, key, f"stored 0x{stored:08x}, read "
                                                       f"0x{actual:08x}"))


def verify_checkpoint(path: str, *, part: int = 0, parts: int = 1) -> None:
    """Check every data file the checkpoint's metadata lists (sizes) and the CRC32 of every
    `parts`-th stored archive from `part` on, streamed in blocks; CorruptFileError naming the
    first damaged file."""
    metadata = read_metadata(path)
    items = sorted(((index, info) for index, info in metadata.storage_data.items()
                    if not isinstance(metadata.state_dict_metadata.get(index.fqn),
                                      BytesStorageMetadata)),
                   key=lambda item: (item[1].relative_path, item[1].offset))
    ends: dict[str, int] = {}
    for _, info in items:
        ends[info.relative_path] = max(ends.get(info.relative_path, 0),
                                       info.offset + info.length)
    for name, end in sorted(ends.items()):
        check_extent(os.path.join(path, name), end)
    for index, info in items[part::parts]:
        _verify_archive(os.path.join(path, info.relative_path), index.fqn, info.offset,
                        info.length)


def verify_checkpoint_collectively(path: str) -> None:
    """`verify_checkpoint` with its archives split over the ranks of the default process group
    (each reads its share once), every rank raising the same error if any finds one."""
    if not dist.is_initialized():
        verify_checkpoint(path)
        return
    try:
        verify_checkpoint(path, part=dist.get_rank(), parts=dist.get_world_size())
        problem = None
    except CorruptFileError as e:
        problem = str(e)
    problems = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    found = [p for p in problems if p is not None]
    if found:
        raise CorruptFileError(found[0])


def _verify_archive(file: str, key: str, offset: int, length: int) -> None:
    """Read every record of the torch.save archive at (offset, length) of `file`; zipfile
    checks each record's CRC32 at its end."""
    try:
        with open(file, "rb") as f, zipfile.ZipFile(ArchiveWindow(f, offset, length)) as zf:
            for info in zf.infolist():
                with zf.open(info) as member:
                    while member.read(_BLOCK):
                        pass
    except (zipfile.BadZipFile, EOFError, ValueError) as e:
        raise CorruptFileError(_crc_message(file, key, str(e))) from None


def _crc_message(file: str, key: str, detail: str) -> str:
    return (f"{file}: tensor {key!r} fails its CRC32 check ({detail}): the file is corrupt; "
            f"restore it or use another checkpoint")
