"""megarlhf/logs.py in a fresh process, as a command or rank meets it at import: third-party
loggers at ERROR and their known-noise warnings ignored, megarlhf's own records as
`warning: ...`, MEGARLHF_LIBRARY_LOGS to see the libraries' output, a library's own variable
winning for it. A whole run's output: tests/test_ppo.py (tests/own_lines.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from megarlhf import logs
from megarlhf.compat.warnings import KNOWN

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBRARIES = ("megatron.core.x", "torch.distributed.x", "vllm.x", "transformers.x", "ray.x")
SCRIPT = f"""
import json, logging, os, sys, warnings
import megarlhf
from megarlhf import logs
for name in {LIBRARIES!r}:
    logging.getLogger(name).warning("%s: a warning", name)
    logging.getLogger(name).error("%s: an error", name)
logging.getLogger("megarlhf.ppo.x").warning("our warning")
logging.getLogger("megarlhf.ppo.x").info("our info")
warnings.warn({KNOWN[0][1]!r} + " (known noise)", {KNOWN[0][0].__name__})
warnings.warn("a warning nobody filtered", UserWarning)
print(json.dumps(logs.library_env()))
"""


def _run(**env: str) -> tuple[list[str], dict]:
    """(stderr lines, library_env()) of a fresh process with only `env` of the variables
    megarlhf/logs.py reads and sets."""
    ours = {logs.ENV, logs.TORCH_CPP, *filter(None, logs.LIBRARY_LOGGERS.values())}
    base = {k: v for k, v in os.environ.items() if k not in ours}
    done = subprocess.run([sys.executable, "-c", SCRIPT], env={**base, **env}, cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stderr.splitlines(), json.loads(done.stdout)


def test_libraries_log_errors_only_and_our_warnings_show():
    lines, env = _run()
    # lastResort prints a library's record bare; ours carry their level
    assert lines == [f"{name}: an error" for name in LIBRARIES] + [
        "warning: our warning", "<string>:11: UserWarning: a warning nobody filtered"]
    assert env == {logs.ENV: "error", "VLLM_LOGGING_LEVEL": "ERROR",
                   "TRANSFORMERS_VERBOSITY": "error", logs.TORCH_CPP: "ERROR"}


def test_the_variable_shows_the_libraries_and_their_own_variables_win():
    lines, env = _run(**{logs.ENV: "warning", "TRANSFORMERS_VERBOSITY": "error"})
    shown = [name for name in LIBRARIES if f"{name}: a warning" in lines]
    assert shown == [name for name in LIBRARIES if name != "transformers.x"]
    assert all(f"{name}: an error" in lines for name in LIBRARIES)
    assert any("(known noise)" in line for line in lines), lines
    assert "warning: our warning" in lines
    assert env == {logs.ENV: "warning", "VLLM_LOGGING_LEVEL": "WARNING",
                   "TRANSFORMERS_VERBOSITY": "error", logs.TORCH_CPP: "WARNING"}
    # A bad value counts as the default here; the commands refuse it (tests/test_bad_inputs.py).
    lines, env = _run(**{logs.ENV: "loud"})
    assert "vllm.x: a warning" not in lines and env["VLLM_LOGGING_LEVEL"] == "ERROR"
