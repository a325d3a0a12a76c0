"""The first code a local rank runs (megarlhf/parallel/launcher.py starts every rank with
`main`): its environment, output streams and thread count, then the function it was started
for.

It lives outside megarlhf.parallel, whose import loads torch and megatron-core: a rank is a
fork of the launcher's server process, and its environment must be in place before any module
its function's pickle names is imported (a GPU hidden by CUDA_VISIBLE_DEVICES stays hidden
only if CUDA reads the variable after it is set).
"""

from __future__ import annotations

import os
import signal
from multiprocessing import reduction
from typing import Callable


class Start:
    """A rank's whole environment and the launching process's stdout and stderr as they are
    now (the server's may point elsewhere: a file since closed, a test's capture), set while
    the rank's start message is unpickled: this object comes before the function and its
    arguments in that message, so their imports see them."""

    def __init__(self, environ: dict[str, str]):
        self.environ = environ

    def __reduce__(self):
        # Pickled while the rank starts, when DupFd can hand the descriptors to the child.
        streams = [(fd, reduction.DupFd(fd)) for fd in (1, 2) if _is_open(fd)]
        return _enter, (self.environ, streams)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _enter(environ: dict[str, str], streams: list) -> None:
    os.environ.clear()
    os.environ.update(environ)
    for target, stream in streams:
        fd = stream.detach()
        os.dup2(fd, target)
        os.close(fd)


def main(started: None, target: Callable, args: tuple) -> None:
    """`started`: the Start given to the start message (unpickled to None, once applied)."""
    # A terminal's Ctrl-C reaches every rank too: the launching process alone handles it (it
    # stops the ranks), so a rank neither dies mid-collective nor prints a traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import torch

    from megarlhf import logs

    # A spawned rank's torch read OMP_NUM_THREADS at import; a forked one read the server's.
    # The library log levels likewise follow this rank's environment.
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    logs.apply()
    target(*args)
