"""Streaming access to HF safetensors checkpoints.

Reading touches one tensor's byte range at a time, never a whole file: `get` reads it into
memory, `view` maps just that range and unmaps it when the tensor is freed. Either way a tensor
occupies memory only while the caller holds it, and the pages of a whole 140 GB checkpoint
never pile up in the process's RSS. Writing streams each tensor to disk as it comes, into
shards of a bounded size, and ends with HF's index file.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import math
import os
import struct

import torch

from megarlhf.convert.pages import map_tensor

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}
_CODES = {dtype: code for code, dtype in _DTYPES.items()}


@dataclasses.dataclass(frozen=True)
class _Entry:
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


class SafetensorsReader:
    """Tensors of an HF checkpoint directory (one file, or shards listed in the index).
    `aliases`: (prefix, replacement) pairs; a name starting with a prefix is known by the
    name with the replacement instead (another spelling of the same tensor)."""

    def __init__(self, directory: str, aliases: tuple[tuple[str, str], ...] = ()):
        self.directory = directory
        index_path = os.path.join(directory, INDEX_NAME)
        if os.path.isfile(index_path):
            with open(index_path) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        elif os.path.isfile(os.path.join(directory, SINGLE_NAME)):
            weight_map, files = None, [SINGLE_NAME]
        else:
            raise ValueError(
                f"no {SINGLE_NAME} or {INDEX_NAME} in {directory}; only safetensors checkpoints "
                f"are read (re-save a .bin checkpoint with "
                f"save_pretrained(safe_serialization=True))"
            )
        self._entries: dict[str, _Entry] = {}
        for name in files:
            self._entries.update(_read_header(os.path.join(directory, name)))
        if weight_map is not None:
            for tensor, file in weight_map.items():
                entry = self._entries.get(tensor)
                if entry is None or os.path.basename(entry.file) != file:
                    raise ValueError(f"{INDEX_NAME} in {directory} lists {tensor} in {file}, but "
                                     f"that file does not hold it: the checkpoint is inconsistent")
        if aliases:
            self._entries = _renamed(self._entries, aliases, directory)

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name].shape

    def dtype(self, name: str) -> torch.dtype:
        return self._entries[name].dtype

    def get(self, name: str, out: torch.Tensor | None = None) -> torch.Tensor:
        """The tensor, read straight from the file into fresh memory or into `out` (a
        contiguous tensor of its shape and dtype)."""
        e = self._entries[name]
        if out is None:
            out = torch.empty(e.shape, dtype=e.dtype)
        elif (tuple(out.shape), out.dtype) != (e.shape, e.dtype) or not out.is_contiguous():
            raise ValueError(f"{name} is {e.dtype} {e.shape}; cannot read it into a "
                             f"{'' if out.is_contiguous() else 'non-contiguous '}"
                             f"{out.dtype} {tuple(out.shape)} tensor")
        with open(e.file, "rb") as f:
            f.seek(e.start)
            if f.readinto(tensor_bytes(out)) != e.end - e.start:
                raise ValueError(f"{e.file} ended while reading {name}: the file is truncated")
        return out

    def view(self, name: str) -> torch.Tensor:
        """The tensor over the file's pages (`pages.map_tensor`): no copy into fresh memory;
        only its byte range is mapped, until the tensor is freed."""
        e = self._entries[name]
        with open(e.file, "rb") as f:
            return map_tensor(f, e.start, math.prod(e.shape), e.dtype).view(e.shape)


def _renamed(entries: dict[str, _Entry], aliases: tuple[tuple[str, str], ...],
             directory: str) -> dict[str, _Entry]:
    renamed = {}
    for name, entry in entries.items():
        for prefix, replacement in aliases:
            if name.startswith(prefix):
                name = replacement + name.removeprefix(prefix)
                break
        if name in renamed:
            raise ValueError(f"{directory} holds {name} under two spellings; keep one")
        renamed[name] = entry
    return renamed


def tensor_bytes(tensor: torch.Tensor) -> ctypes.Array:
    """A contiguous tensor's memory as a writable byte buffer (any dtype, bf16 included), to
    use while the tensor is alive. Not through numpy, which would pin the tensor's storage to
    its size: a converter frees a tensor's memory by resizing its storage."""
    return (ctypes.c_char * tensor.nbytes).from_address(tensor.data_ptr())


def _read_header(path: str) -> dict[str, _Entry]:
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path} is not a safetensors file (shorter than its header)")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise ValueError(f"{path} is truncated: its header claims {n} bytes")
        header = json.loads(f.read(n))
    header.pop("__metadata__", None)
    base = 8 + n
    entries = {}
    for name, info in header.items():
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
        start, end = info["data_offsets"]
        if base + end > size:
            raise ValueError(
                f"{path} is truncated: tensor {name} (shape {tuple(info['shape'])}, "
                f"{info['dtype']}) needs bytes up to {base + end} but the file has {size}"
            )
        entries[name] = _Entry(path, _DTYPES[info["dtype"]], tuple(info["shape"]), base + start,
                               base + end)
    return entries


class ShardWriter:
    """Writes tensors, announced up front as (name, dtype, shape) in the order they will be
    added, into `model-0000k-of-0000n.safetensors` shards of at most about `max_shard_bytes`
    each, then HF's index. Knowing every shard's members up front lets each shard's header go
    out before its data, so every tensor is on disk when `add` returns and none is held.

    Use as a context manager: the index is written only when the block completes."""

    def __init__(self, directory: str, max_shard_bytes: int,
                 entries: list[tuple[str, torch.dtype, tuple[int, ...]]]):
        if max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.directory = directory
        self._shards = _plan_shards(entries, max_shard_bytes)
        n = len(self._shards)
        self._files = [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
        self._order = [(k, entry) for k, shard in enumerate(self._shards) for entry in shard]
        self._added, self._shard, self._stream = 0, None, None
        self._open(0)

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._stream.close()
        if exc_type is None:
            self._finish()

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self._added == len(self._order):
            raise ValueError(f"{name} was not announced to the writer")
        k, expected = self._order[self._added]
        got = (name, tensor.dtype, tuple(tensor.shape))
        if got != expected:
            raise ValueError(f"writer expected {expected} next, got {got}")
        if k != self._shard:
            self._open(k)
        self._stream.write(tensor_bytes(tensor.contiguous()))
        self._added += 1

    def _open(self, k: int) -> None:
        if self._stream is not None:
            self._stream.close()
        self._shard, self._stream = k, open(os.path.join(self.directory, self._files[k]), "wb")
        self._stream.write(_header(self._shards[k]))

    def _finish(self) -> None:
        if self._added != len(self._order):
            raise ValueError(f"only {self._added} of the {len(self._order)} announced tensors "
                             f"were added")
        weight_map = {name: self._files[k] for k, (name, _, _) in self._order}
        total = sum(_nbytes(entry) for _, entry in self._order)
        with open(os.path.join(self.directory, INDEX_NAME), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f,
                      indent=2)


def _nbytes(entry) -> int:
    _, dtype, shape = entry
    return math.prod(shape) * dtype.itemsize


def _plan_shards(entries, max_shard_bytes: int) -> list[list]:
    """Consecutive runs of `entries` of at most `max_shard_bytes` each (a larger tensor alone)."""
    shards, size = [[]], 0
    for entry in entries:
        if shards[-1] and size + _nbytes(entry) > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += _nbytes(entry)
    return shards


def _header(entries) -> bytes:
    """A safetensors header for `entries`, their data following in this order."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape in entries:
        if dtype not in _CODES:
            raise ValueError(f"safetensors cannot store {name} of dtype {dtype}")
        end = offset + _nbytes((name, dtype, shape))
        header[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    return struct.pack("<Q", len(raw)) + raw
