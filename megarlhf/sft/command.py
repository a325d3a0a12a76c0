"""`megarlhf sft` and `megarlhf rm`: load and check the YAML config, then train on the ranks
torchrun / srun started, on `--nproc` ranks spawned here, or in this process alone."""

from __future__ import annotations

import functools
import math
import os

from megarlhf.parallel import launch_local
from megarlhf.sft.config import RMConfig, SFTConfig
from megarlhf.configio import load_config
from megarlhf.sft.loop import plan
from megarlhf.sft.rm import rm_stage, run_rm
from megarlhf.sft.sft import run_sft, sft_stage

STAGES = {"sft": (SFTConfig, sft_stage, run_sft), "rm": (RMConfig, rm_stage, run_rm)}


def main(stage: str, config_path: str, overrides: list[str], nproc: int | None) -> dict:
    config_cls, make_stage, run = STAGES[stage]
    cfg = load_config(config_cls, config_path, overrides)
    if nproc is None:
        return run(cfg)
    if "RANK" in os.environ or "SLURM_PROCID" in os.environ:
        raise ValueError("--nproc spawns its own ranks; leave it out under torchrun or srun")
    # Data, tokenizer and resume problems surface here as one plain error, not as a traceback
    # from each spawned rank.
    plan(cfg, functools.partial(make_stage, cfg))
    # A training run has no natural time limit; the launcher's default is meant for tests.
    return launch_local(run, nproc, cfg, timeout_s=math.inf)[0]
