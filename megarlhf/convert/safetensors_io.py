"""Streaming access to HF safetensors checkpoints.

Reading uses plain file reads, not mmap: a tensor occupies memory only while the caller holds
it, and mapped pages of a whole 140 GB checkpoint never pile up in the process's RSS. Writing
fills shards of a bounded size and ends with HF's index file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct

import torch
from safetensors.torch import save_file

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}


@dataclasses.dataclass(frozen=True)
class _Entry:
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    end: int


class SafetensorsReader:
    """Tensors of an HF checkpoint directory (one file, or shards listed in the index)."""

    def __init__(self, directory: str):
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

    def names(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name].shape

    def dtype(self, name: str) -> torch.dtype:
        return self._entries[name].dtype

    def get(self, name: str) -> torch.Tensor:
        e = self._entries[name]
        buf = bytearray(e.end - e.start)
        with open(e.file, "rb") as f:
            f.seek(e.start)
            if f.readinto(buf) != len(buf):
                raise ValueError(f"{e.file} ended while reading {name}: the file is truncated")
        if not buf:
            return torch.empty(e.shape, dtype=e.dtype)
        return torch.frombuffer(buf, dtype=e.dtype).reshape(e.shape)


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
    """Writes named tensors into `model-0000k-of-0000n.safetensors` shards of at most about
    `max_shard_bytes` each, then HF's index; only the current shard is held in memory."""

    def __init__(self, directory: str, max_shard_bytes: int):
        if max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.directory, self.max_shard_bytes = directory, max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []
        self._total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.contiguous()
        self._pending_bytes += nbytes
        self._total += nbytes

    def _flush(self) -> None:
        path = os.path.join(self.directory, f"shard-{len(self._shards):05d}.part")
        save_file(self._pending, path, metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> None:
        if self._pending or not self._shards:
            self._flush()
        n = len(self._shards)
        weight_map = {}
        for k, names in enumerate(self._shards):
            final = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            os.replace(os.path.join(self.directory, f"shard-{k:05d}.part"),
                       os.path.join(self.directory, final))
            weight_map.update({name: final for name in names})
        with open(os.path.join(self.directory, INDEX_NAME), "w") as f:
            json.dump({"metadata": {"total_size": self._total}, "weight_map": weight_map}, f,
                      indent=2)
