"""Writing a converter's or an export's output safely: checked before any work, written to a
temporary sibling that is removed if anything fails, renamed into place only when complete.

Nothing we did not write is deleted or replaced: an existing output is replaced only when it
is empty or holds one of our markers (EXPORT_MARKER in HF directories we write, the completion
marker in Megatron checkpoints), and an output is never the input, inside it, or around it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil

from megarlhf.engine.checkpoint import COMPLETE_MARKER

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")

EXPORT_MARKER = "megarlhf_export.json"
"""Written into every HF directory we export (transformers and vLLM ignore it)."""
_TMP_MARKER = ".megarlhf-tmp"


def check_output(out: str, *, inputs: list[str], replace: bool, what: str = "output") -> None:
    """ValueError unless `out` may be written: not one of `inputs`, inside one or holding one;
    not an existing file; an existing directory only with `replace`, and only if it is empty
    or ours; and under a directory (not a file)."""
    real = os.path.realpath(out)
    for source in inputs:
        src = os.path.realpath(source)
        if real == src or _inside(real, src) or _inside(src, real):
            relation = ("is" if real == src else "is inside" if _inside(real, src)
                        else "contains")
            raise ValueError(f"{what} {out} {relation} the input {source}; writing it would "
                             f"replace what it is made from: choose another {what}")
    if os.path.lexists(out) and not os.path.isdir(out):
        raise ValueError(f"{what} {out} is a file; name a directory")
    if os.path.isdir(out) and os.listdir(out):
        if not replace:
            raise ValueError(f"{what} {out} already exists; pass --force to replace it")
        if not ours(out):
            raise ValueError(f"{what} {out} exists and was not written by megarlhf (it has no "
                             f"{EXPORT_MARKER} or {COMPLETE_MARKER}): choose another "
                             f"{what}, or empty or remove it yourself")
    parent = os.path.dirname(os.path.abspath(out))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"{what} {out}: {parent} is a file, not a directory")


def ours(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, m)) for m in (EXPORT_MARKER,
                                                               COMPLETE_MARKER))


def prepare_output(out: str, force: bool, *, inputs: list[str]) -> str:
    """A fresh temporary directory next to `out` (checked with `check_output` first)."""
    check_output(out, inputs=inputs, replace=force)
    out = os.path.abspath(out)
    tmp = temporary_sibling(out)
    if os.path.exists(tmp):
        if not os.path.isfile(os.path.join(tmp, _TMP_MARKER)):
            raise ValueError(f"{tmp} exists and is not a temporary directory of ours; remove "
                             f"it or choose another output")
        shutil.rmtree(tmp)  # left by an interrupted conversion
    os.makedirs(tmp)
    open(os.path.join(tmp, _TMP_MARKER), "w").close()
    return tmp


def temporary_sibling(out: str) -> str:
    """Where `out` is written before it is renamed into place: hidden, and named so that no
    user directory is mistaken for it."""
    parent, name = os.path.split(os.path.abspath(out))
    return os.path.join(parent, f".{name}.megarlhf-tmp")


def finish_output(tmp: str, marker: dict | None = None) -> None:
    """Drop the temporary marker; for an HF export, write EXPORT_MARKER with `marker`."""
    os.remove(os.path.join(tmp, _TMP_MARKER))
    if marker is not None:
        with open(os.path.join(tmp, EXPORT_MARKER), "w") as f:
            json.dump(marker, f, indent=1)


@contextlib.contextmanager
def removed_on_error(tmp: str):
    """Delete the temporary output if writing it fails, so nothing half-written remains."""
    try:
        yield
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def copy_sidecar(src: str, dst: str) -> None:
    """Copy config, generation config and tokenizer files (everything but weights and our
    own markers)."""
    os.makedirs(dst, exist_ok=True)
    for name in sorted(os.listdir(src)):
        path = os.path.join(src, name)
        if os.path.isfile(path) and not name.endswith(_WEIGHT_SUFFIXES) \
                and not name.endswith(".index.json") \
                and name not in (EXPORT_MARKER, COMPLETE_MARKER, _TMP_MARKER):
            shutil.copy2(path, os.path.join(dst, name))


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root and path != root
