"""Writing a converter's output safely: a temporary directory next to the target, removed if
anything fails, renamed into place only when complete."""

from __future__ import annotations

import contextlib
import os
import shutil

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")


def prepare_output(out: str, force: bool) -> str:
    """A fresh temporary directory next to `out`; refuses an existing `out` without `force`."""
    out = os.path.abspath(out)
    if os.path.exists(out) and not force:
        raise ValueError(f"output {out} already exists; pass --force to replace it")
    tmp = f"{out}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    return tmp


@contextlib.contextmanager
def removed_on_error(tmp: str):
    """Delete the temporary output if writing it fails, so nothing half-written remains."""
    try:
        yield
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def copy_sidecar(src: str, dst: str) -> None:
    """Copy config, generation config and tokenizer files (everything but weights)."""
    os.makedirs(dst, exist_ok=True)
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if os.path.isfile(path) and not name.endswith(_WEIGHT_SUFFIXES) \
                and not name.endswith(".index.json"):
            shutil.copy2(path, os.path.join(dst, name))
