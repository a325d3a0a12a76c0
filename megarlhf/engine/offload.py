"""Taking an idle TrainEngine's memory off the device, and putting it back, in place.

Three kinds of state, each switched on its own (PPOConfig's offload_params, offload_grads,
offload_optimizer):

- params: the weights (DDP's parameter buffer, or each parameter of a frozen model), copied
  to host memory (pinned on a GPU machine, so the copy back runs at full bus speed);
- grads: DDP's fp32 main-grad buffers, freed without a copy: every train step zeroes them
  before its backward, so what they hold between steps is never read again. They come
  back zeroed;
- optimizer: the optimizer's tensors (Adam's moments and step, the fp32 master weights of
  16-bit params), copied to host memory.

Everything is moved by storage, not by tensor: a storage's memory is released with
`resize_(0)` and re-allocated with its old size, so every tensor object and view onto it
(parameters, `main_grad` views, the distributed optimizer's shard views, the weight bridge's
pieces) stays valid across the round trip, and the bytes come back bitwise equal. A storage
shared by two kinds (the fp32 master weights of fp32 params are views of the parameters) is
moved with the first kind that owns it: params, then grads, then optimizer. `release` and
`reallocate` are the one way this is done: the rollout engines' sleep uses them too.

While a kind is offloaded its tensors must not be touched (their storage is empty; any use
raises). On a CPU-only machine the "device" is host memory too: the mechanism is the same
(the tests check it there), the memory saved is not.
"""

from __future__ import annotations

from typing import Iterable

import torch

KINDS = ("params", "grads", "optimizer")


class Offloader:
    """The offloadable state of one engine (`megarlhf.engine.train.TrainEngine`)."""

    def __init__(self, engine):
        self.engine = engine
        self._host: dict[str, list[tuple[torch.UntypedStorage, int, torch.Tensor | None]]] = {}
        self._spare: dict[int, list[torch.Tensor]] = {}
        """Host buffers of earlier round trips by size, for the next offload: pinning memory
        costs more than the copy (an H200 moved 17 GB to fresh pinned buffers at 1.5 GB/s and
        back at 51 GB/s). Storages keep their sizes, so each finds its buffer again; the host
        memory stays held between offloads, as the planner already counts it."""

    @property
    def offloaded(self) -> frozenset[str]:
        return frozenset(self._host)

    def kinds(self) -> tuple[str, ...]:
        """The kinds this engine has (a frozen engine: params only)."""
        return KINDS if self.engine.optimizer is not None else ("params",)

    @torch.no_grad()
    def offload(self, kinds: Iterable[str]) -> None:
        """Release the device memory of `kinds` (those already offloaded are skipped)."""
        kinds = [k for k in KINDS if k in set(kinds) and k not in self._host]
        if not kinds:
            return
        # Every kind's storages are claimed in order, offloaded or not, so a shared storage
        # goes with the first kind (an empty storage, already offloaded, is nobody's).
        owned: dict[int, torch.UntypedStorage] = {}
        moved = []
        for kind in KINDS:
            storages = storages_of([self.tensors(kind)])
            fresh = {key: s for key, s in storages.items() if key not in owned}
            owned.update(storages)
            if kind in kinds:
                entries = []
                for storage in fresh.values():
                    host = None
                    if kind != "grads":
                        host = self._host_buffer(storage)
                        host.copy_(as_bytes(storage), non_blocking=True)
                    entries.append((storage, storage.nbytes(), host))
                self._host[kind] = entries
                moved += entries
        if any(s.device.type == "cuda" for s, _, _ in moved):
            torch.cuda.synchronize()  # the copies must land before the memory is released
        release(s for s, _, _ in moved)

    @torch.no_grad()
    def reload(self, kinds: Iterable[str]) -> None:
        """Allocate `kinds` again and copy their bytes back (grads: zeros)."""
        cuda = False
        for kind in [k for k in KINDS if k in set(kinds) and k in self._host]:
            for storage, nbytes, host in self._host.pop(kind):
                reallocate([(storage, nbytes)], zero=host is None)
                if host is not None:
                    as_bytes(storage).copy_(host, non_blocking=True)
                    self._spare.setdefault(nbytes, []).append(host)  # read after the sync
                cuda = cuda or storage.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()  # the weights must be back before they are used

    def _host_buffer(self, storage: torch.UntypedStorage) -> torch.Tensor:
        spare = self._spare.get(storage.nbytes())
        if spare:
            return spare.pop()
        return torch.empty(storage.nbytes(), dtype=torch.uint8,
                           pin_memory=storage.device.type == "cuda")

    def device_bytes(self) -> int:
        """Bytes of this engine's state that are on the device now (every kind it has)."""
        return sum(s.nbytes() for s in storages_of(self.tensors(k) for k in self.kinds()).values())

    def tensors(self, kind: str) -> list[torch.Tensor]:
        """The engine's tensors of `kind` (views may share storages)."""
        params = [p for chunk in self.engine.chunks for p in chunk.parameters()]
        if kind == "params":
            return params
        if kind == "grads":
            return [p.main_grad for p in params if getattr(p, "main_grad", None) is not None]
        tensors = []
        for inner in _torch_optimizers(self.engine.optimizer):
            for group in inner.param_groups:
                tensors += group["params"]
            for state in inner.state.values():
                tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
        return tensors


def _torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside a megatron-core optimizer (one, or one per chained part)."""
    if optimizer is None:
        return []
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [p.optimizer for p in parts if getattr(p, "optimizer", None) is not None]


def storages_of(groups: Iterable[Iterable[torch.Tensor]]) -> dict[int, torch.UntypedStorage]:
    """The distinct non-empty storages under the tensors, by address."""
    out = {}
    for tensors in groups:
        for t in tensors:
            storage = t.untyped_storage()
            if storage.nbytes():
                out.setdefault(storage.data_ptr(), storage)
    return out


def release(storages: Iterable[torch.UntypedStorage]
            ) -> list[tuple[torch.UntypedStorage, int]]:
    """Free the storages' memory in place (every tensor and view onto them stays a valid
    object); returns what `reallocate` needs."""
    released = [(s, s.nbytes()) for s in storages]
    for storage, _ in released:
        storage.resize_(0)
    return released


def reallocate(released: list[tuple[torch.UntypedStorage, int]], *, zero: bool = False
               ) -> None:
    """Undo `release`: the old sizes, contents undefined unless `zero`."""
    for storage, nbytes in released:
        storage.resize_(nbytes)
        if zero:
            as_bytes(storage).zero_()


def as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
