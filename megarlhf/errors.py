"""How every command ends when something expected goes wrong: one or two lines on stderr that
name the field or path and the fix, exit code 2 for bad input (config, files, disks), 1 for a
fault no restart got past, 75 for a restart that found no room on the cluster (a lost node: a
new allocation may have it, so launch/ppo.sbatch requeues the job), 130 for Ctrl-C, and no
traceback unless MEGARLHF_DEBUG=1.

Expected failures are `ValueError` (our checks raise it with the message the user reads),
`OSError` (a path that is missing, read-only, on a full disk, ...) and YAML syntax errors.
Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Callable

import yaml

FAULT = 1
BAD_INPUT = 2
NO_ROOM = 75  # EX_TEMPFAIL: try again later
INTERRUPTED = 130


class CorruptFileError(ValueError):
    """A file we wrote does not read back as written (checksum, size, missing)."""


class RunFault(RuntimeError):
    """A run stopped by a fault outside its code (a lost rank, a hang) that no restart got
    past: its message names the fault and the last checkpoint."""

    exit_code = FAULT


class NoRoom(RunFault):
    """A restart after a fault found too little room for the run's ranks (a node lost for
    good): the same job on a new allocation resumes from the last checkpoint."""

    exit_code = NO_ROOM


def debug() -> bool:
    return os.environ.get("MEGARLHF_DEBUG", "") not in ("", "0")


def describe(e: BaseException) -> str:
    """The one-line (or two-line) message for an expected failure."""
    if isinstance(e, OSError) and e.filename is not None:
        path = e.filename if e.filename2 is None else f"{e.filename} -> {e.filename2}"
        return f"{path}: {e.strerror or e}"
    if isinstance(e, yaml.YAMLError):
        mark = getattr(e, "problem_mark", None)
        where = f"{mark.name}:{mark.line + 1}:{mark.column + 1}: " if mark else ""
        return f"{where}YAML syntax error: {getattr(e, 'problem', None) or e}"
    return str(e)


def run_command(fn: Callable[..., int | None], *args, **kwargs) -> int:
    """Call a command's body and turn expected failures into a message and an exit code."""
    try:
        return fn(*args, **kwargs) or 0
    except KeyboardInterrupt:
        if debug():
            raise
        print("interrupted (Ctrl-C): the ranks were stopped; the last completed checkpoint "
              "is intact and a rerun resumes from it", file=sys.stderr)
        return INTERRUPTED
    except RunFault as e:
        if debug():  # the traceback too, but the same exit code (75 requeues a Slurm job)
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except (ValueError, OSError, yaml.YAMLError) as e:
        if debug():
            raise
        print(f"error: {describe(e)}", file=sys.stderr)
        return BAD_INPUT
