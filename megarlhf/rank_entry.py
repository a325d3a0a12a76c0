"""The first code a local rank runs (megarlhf/parallel/launcher.py starts every rank with
`main`): its environment and thread count, then the function it was started for.

It lives outside megarlhf.parallel, whose import loads torch and megatron-core: a rank is a
fork of the launcher's server process, and its environment must be in place before any module
its function's pickle names is imported (a GPU hidden by CUDA_VISIBLE_DEVICES stays hidden
only if CUDA reads the variable after it is set).
"""

from __future__ import annotations

import os
import signal
from typing import Callable


class Environ:
    """A rank's whole environment, set while its start message is unpickled: this object
    comes before the function and its arguments in that message, so their imports see it."""

    def __init__(self, environ: dict[str, str]):
        self.environ = environ

    def __reduce__(self):
        return _set, (self.environ,)


def _set(environ: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(environ)


def main(environ: None, threads: int, target: Callable, args: tuple) -> None:
    """`environ`: the Environ given to the start message (unpickled to None, once set)."""
    # A terminal's Ctrl-C reaches every rank too: the launching process alone handles it (it
    # stops the ranks), so a rank neither dies mid-collective nor prints a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch

    from megarlhf import logs

    # A spawned rank's torch read its OMP_NUM_THREADS at import; a forked one read the
    # server's. The library log levels likewise follow this rank's environment.
    torch.set_num_threads(threads)
    logs.apply()
    target(*args)
