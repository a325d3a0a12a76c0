"""Command-line converters between HF checkpoints and Megatron dist checkpoints.

    python -m tools.convert_hf.hf_to_mcore --hf DIR --out DIR --tp N --pp M [--vpp V]
        [--ep E --etp T] [--role R]
    python -m tools.convert_hf.mcore_to_hf --ckpt DIR --out DIR [--dtype bf16|fp16|fp32]
    python -m tools.convert_hf.verify --hf DIR --ckpt DIR [--tp N --pp M --ep E --etp T]
"""

from __future__ import annotations

import logging
import sys
from typing import Callable


def run(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> None:
    """Run a CLI entry point: bad input prints one clear line and exits 2 (megarlhf.errors)."""
    from megarlhf.errors import run_command

    # Our progress at INFO; the libraries keep the levels megarlhf/logs.py gave them.
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(run_command(main, argv))
