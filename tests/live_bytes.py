"""Peak bytes of CPU tensors alive at once while a piece of code runs.

RSS cannot tell: gloo's collectives and glibc keep freed buffers in the process. This mode
sees every tensor a torch op creates (factories, copies, casts, collectives' outputs) and
follows its storage until the storage is freed, so views keep their base counted.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class LiveBytes(TorchDispatchMode):
    """Counts storages created while active; tensors that existed before are not counted."""

    def __init__(self):
        super().__init__()
        self._live: dict[int, int] = {}
        self.current = self.peak = 0

    def _freed(self, key: int) -> None:
        self.current -= self._live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # An output on an input's storage (a view, detach, in-place op) allocated nothing.
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key and key not in self._live and key not in inputs:
                    self._live[key] = storage.nbytes()
                    self.current += storage.nbytes()
                    self.peak = max(self.peak, self.current)
                    weakref.finalize(storage, self._freed, key)
        return out
