"""What a run prints besides its results: megarlhf's own log lines, and third-party libraries
kept at error level. The one place both are set; `apply` runs when megarlhf is imported, so
the command's process and every rank and worker process gets it (local ranks import megarlhf
first and inherit the environment set here; Ray workers are handed `library_env()`).

- megarlhf's own log records print on stderr as `warning: ...` (the level in lower case, then
  the message), like a command's `error: ...` line, unless logging is configured elsewhere (an
  application's or pytest's handlers on the root logger then get them instead).
- Third-party libraries (megatron-core, torch, vLLM, transformers, Ray) log at ERROR only, and
  the warnings known to be noise (compat/warnings.py) are ignored: their errors and tracebacks
  still show. `MEGARLHF_LIBRARY_LOGS=warning|info|debug` shows their logs at that level and
  every warning. A library's own variable (VLLM_LOGGING_LEVEL, TRANSFORMERS_VERBOSITY,
  TORCH_CPP_LOG_LEVEL), when set, wins for that library.
"""

from __future__ import annotations

import logging
import os
import sys

from megarlhf.compat.warnings import quiet_known_warnings

ENV = "MEGARLHF_LIBRARY_LOGS"
LEVELS = ("error", "warning", "info", "debug")
"""Accepted values of ENV, the default first."""
LIBRARY_LOGGERS = {
    # Python logger: the variable the library sets that logger's level from (None: none).
    # vLLM reads its variable when it configures logging, after its first records (Triton's
    # check at import) have gone out through this level.
    "megatron": None,
    "torch": None,
    "ray": None,  # the driver's: ray_group.py passes it to ray.init, which sets it again
    "vllm": "VLLM_LOGGING_LEVEL",
    "transformers": "TRANSFORMERS_VERBOSITY",
}
TORCH_CPP = "TORCH_CPP_LOG_LEVEL"
"""torch's C++ warnings (c10d, vLLM's CPU NUMA binding); read when torch is imported."""


def level(*, strict: bool = False) -> str:
    """The level asked for in ENV (default error). A bad value raises ValueError when
    `strict` (the command checks it first), else counts as the default."""
    raw = os.environ.get(ENV, "")
    value = raw.strip().lower() or LEVELS[0]
    if value in LEVELS:
        return value
    if strict:
        raise ValueError(f"{ENV}={raw!r}: expected one of {', '.join(LEVELS)} (third-party "
                         f"library logs; default {LEVELS[0]})")
    return LEVELS[0]


def check() -> None:
    """Refuse a bad ENV value (every command calls this first)."""
    level(strict=True)


def _derived(name: str) -> dict[str, str]:
    return {ENV: name, "VLLM_LOGGING_LEVEL": name.upper(), "TRANSFORMERS_VERBOSITY": name,
            TORCH_CPP: "INFO" if name == "debug" else name.upper()}


def library_env() -> dict[str, str]:
    """The environment a worker process needs before it imports anything: ENV and the
    libraries' own variables, as this process has them (for Ray workers, which do not inherit
    the driver's environment on a running cluster)."""
    return {key: os.environ.get(key, value) for key, value in _derived(level()).items()}


def python_level(logger: str) -> int:
    """The level for a third-party library's Python logger."""
    asked = level()
    variable = LIBRARY_LOGGERS.get(logger)
    if variable:
        asked = os.environ.get(variable, asked)
    value = logging.getLevelName(asked.strip().upper())
    return value if isinstance(value, int) else logging.ERROR


class _OwnLines(logging.Handler):
    """megarlhf's records as `level: message` on stderr (looked up at each record, so a
    redirected stderr gets them), when the root logger has no handler of its own."""

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger().handlers:
            return  # propagated to the handlers logging was configured with
        try:
            text = f"{record.levelname.lower()}: {record.getMessage()}"
            if record.exc_info:
                text += "\n" + logging.Formatter().formatException(record.exc_info)
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 - logging's own policy for a failing handler
            self.handleError(record)


def apply() -> None:
    """Set the libraries' variables (unless set), their loggers' levels and the warning
    filters in this process, and megarlhf's own handler. Safe to call more than once."""
    name = level()
    for key, value in _derived(name).items():
        os.environ.setdefault(key, value)
    for logger in LIBRARY_LOGGERS:
        logging.getLogger(logger).setLevel(python_level(logger))
    quiet_known_warnings(name == LEVELS[0])
    own = logging.getLogger("megarlhf")
    if not any(isinstance(h, _OwnLines) for h in own.handlers):
        own.addHandler(_OwnLines())
