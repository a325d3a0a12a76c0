"""Delta weight sync (`sync_mode: delta`): a disaggregated sync sends, per bridge bucket, only
the elements whose bits changed since the last sync.

Between two optimizer steps most bf16 weights keep their bits (a small update rounds away);
in fp32 nearly every element moves, and a bucket whose delta would not be smaller than the
bucket itself goes whole. Both sides keep the last bucket they exchanged, in host memory:
the sender to compare the new bucket with, each engine process to patch (vLLM on CPU repacks
the weights it loads, so they cannot be patched in place). The patched bucket then loads
through the engine's ordinary path.

Per bucket, every channel member takes part in:
1. a header from the sending stage: mode (full or delta), the number of changed elements,
   and the CRC-32 of the base the delta applies to and of the new bucket;
2. an all-reduce (MIN) of each member's "I hold that base" flag: one engine without it (a
   restarted engine process, a resumed trainer) turns the bucket into a full one for all;
3. the full bucket, or the changed elements' values with their indices or a bitmap of them
   (a bit per element), whichever of the three is smallest.
Every engine process checks the CRC-32 of what it then holds against the sender's, so the
weights after a delta sync are the bits a full sync gives or the run stops. The controller
asks for a whole sync now and then (`start(whole=True)`; PPOConfig.delta_full_every).
"""

from __future__ import annotations

import dataclasses
import zlib

import numpy as np
import torch

FULL, INDICES, BITMAP = 0, 1, 2
"""How a bucket travels: whole; its changed elements' int32 (int64 past 2**31) indices and
values; or a bitmap of the changed elements (a bit each) and their values."""
UNKNOWN = -1
"""A header's changed count when the sender kept no base to compare with."""
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def crc32(buffer: torch.Tensor) -> int:
    return zlib.crc32(memoryview(buffer.view(torch.uint8).numpy()))


def _index_dtype(numel: int) -> torch.dtype:
    return torch.int32 if numel < 2**31 else torch.int64


def _encoded_bytes(mode: int, numel: int, count: int, item: int) -> int:
    """Bytes a bucket of `numel` elements of `item` bytes, `count` of them changed, sends."""
    if mode == FULL:
        return numel * item
    if mode == INDICES:
        return count * (_index_dtype(numel).itemsize + item)
    return (numel + 7) // 8 + count * item


def _pack(mask: torch.Tensor) -> torch.Tensor:
    """A bool mask as bits, 8 to a byte, least significant first (numpy's packbits: ten
    times torch's arithmetic on this machine)."""
    return torch.from_numpy(np.packbits(mask.numpy(), bitorder="little"))


def _unpack(packed: torch.Tensor, numel: int) -> torch.Tensor:
    return torch.from_numpy(np.unpackbits(packed.numpy(), count=numel,
                                          bitorder="little")).view(torch.bool)


def _bits(buffer: torch.Tensor) -> torch.Tensor:
    """The buffer as integers of its element size: compared bit for bit (NaN == NaN of the
    same payload, -0.0 != 0.0)."""
    return buffer.view(_BITS[buffer.element_size()])


@dataclasses.dataclass
class SyncStats:
    """What one sync moved, as the engine side saw it."""

    elements: int = 0
    changed: int = 0
    """Elements whose bits changed (all of a bucket whose sender kept nothing to compare
    with: the first sync, or after a restart)."""
    sent_bytes: int = 0
    full_bytes: int = 0
    """What a full sync sends."""
    delta_buckets: int = 0
    buckets: int = 0

    def metrics(self) -> dict[str, float]:
        return {"sync/sent_mib": self.sent_bytes / 2**20,
                "sync/full_mib": self.full_bytes / 2**20,
                "sync/changed_fraction": self.changed / max(self.elements, 1),
                "sync/delta_buckets": float(self.delta_buckets),
                "sync/buckets": float(self.buckets)}


class _Base:
    """The last bucket a member exchanged, with its CRC-32."""

    def __init__(self, buffer: torch.Tensor):
        self.buffer, self.crc = buffer, None


class DeltaChannel:
    """One member's side of delta sync over a bridge `Channel` (the sender of a stage, or an
    engine process)."""

    def __init__(self, channel, *, engine: bool):
        self.channel, self.engine = channel, engine
        self._bases: dict[int, _Base] = {}
        self._whole = True
        self._spare: torch.Tensor | None = None
        self.stats = SyncStats()

    def start(self, whole: bool) -> None:
        """A new sync; `whole`: its sender sends every bucket whole."""
        self.stats, self._whole = SyncStats(), whole

    def _scratch(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A buffer reused across buckets and syncs, for a member that only takes part in a
        broadcast (a fresh one per bucket page-faults the model in again at every sync)."""
        if self._spare is None or self._spare.numel() < numel \
                or self._spare.dtype != dtype:
            self._spare = torch.empty(numel, dtype=dtype)
        return self._spare[:numel]

    def _header(self, index: int, buffer: torch.Tensor | None, root: int):
        """Every member: the bucket's header from its sender (buffer given), who chooses the
        smallest encoding. Returns (header, the changed elements' mask on the sender where it
        compared)."""
        header = torch.tensor([FULL, UNKNOWN, 0, 0], dtype=torch.int64)
        changed = None
        if buffer is not None:
            header[3] = crc32(buffer)
            base = self._bases.get(index)
            if base is not None:
                changed = _bits(buffer) != _bits(base.buffer)
                count = int(torch.count_nonzero(changed))
                header[1:3] = torch.tensor([count, base.crc])
                if not self._whole:
                    header[0] = min((FULL, INDICES, BITMAP), key=lambda mode: _encoded_bytes(
                        mode, buffer.numel(), count, buffer.element_size()))
        self.channel.broadcast(header, root)
        return header, changed

    def exchange(self, index: int, numel: int, dtype: torch.dtype, root: int,
                 buffer: torch.Tensor | None = None) -> torch.Tensor | None:
        """Bucket `index` (`numel` elements of `dtype`, sent from channel rank `root`):
        `buffer` on its sender; the bucket as the engine now holds it on an engine process
        (a tensor it keeps: the caller must not write into it); None elsewhere."""
        sender = buffer is not None
        header, changed = self._header(index, buffer, root)
        mode, count, base_crc, new_crc = (int(v) for v in header)
        base = self._bases.get(index)
        holds = not self.engine or mode == FULL or (base is not None and base.crc == base_crc)
        flag = torch.tensor([int(holds)], dtype=torch.int64)
        self.channel.all_reduce_min(flag)
        if mode != FULL and not int(flag):
            mode = FULL  # an engine lacks the base: everyone falls back to the whole bucket
        item = torch.empty((), dtype=dtype).element_size()
        if mode != FULL:
            if mode == INDICES:
                where = changed.nonzero().squeeze(1).to(_index_dtype(numel)) if sender \
                    else torch.empty(count, dtype=_index_dtype(numel))
            else:
                where = _pack(changed) if sender else torch.empty((numel + 7) // 8,
                                                                  dtype=torch.uint8)
            values = buffer[changed] if sender else torch.empty(count, dtype=dtype)
            if count:
                self.channel.broadcast(where, root)
                self.channel.broadcast(values, root)
            if sender:
                base.buffer.copy_(buffer)
            elif self.engine and count:
                base.buffer[where.long() if mode == INDICES else _unpack(where, numel)] = values
            sent = _encoded_bytes(mode, numel, count, item)
        else:
            if sender:
                whole = buffer
            elif self.engine:  # into the bucket kept from the last sync, if there is one
                whole = base.buffer if base is not None and base.buffer.numel() == numel \
                    and base.buffer.dtype == dtype else torch.empty(numel, dtype=dtype)
            else:
                whole = self._scratch(numel, dtype)
            self.channel.broadcast(whole, root)
            if (sender or self.engine) and (base is None or base.buffer is not whole):
                if base is not None and base.buffer.shape == whole.shape \
                        and base.buffer.dtype == whole.dtype:
                    base.buffer.copy_(whole)  # the sender's buffer is reused: keep a copy
                else:
                    base = self._bases[index] = _Base(whole.clone() if sender else whole)
            sent = numel * item
            count = numel if count == UNKNOWN else count
        self.stats.buckets += 1
        self.stats.delta_buckets += mode != FULL
        self.stats.elements += numel
        self.stats.changed += count
        self.stats.sent_bytes += sent
        self.stats.full_bytes += numel * item
        if not (sender or self.engine):
            return None
        held = new_crc if sender else crc32(base.buffer)
        if held != new_crc:
            del self._bases[index]  # nothing to patch next time: it goes whole
            raise RuntimeError(f"weight sync: bucket {index} differs from the trainer's after "
                               f"a {'full' if mode == FULL else 'delta'} sync (CRC-32 "
                               f"{held:#x} vs {new_crc:#x}); the engine's weights are not the "
                               f"trained ones")
        base.crc = new_crc
        return base.buffer if self.engine else None

