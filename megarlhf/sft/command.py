"""`megarlhf sft`, `megarlhf rm` and `megarlhf dpo`: load and check the YAML config, then
train on the ranks torchrun / srun started, on `--nproc` ranks started here, or in this
process alone."""

from __future__ import annotations

import functools
import math

from megarlhf import profiling
from megarlhf.models.specs import resolve_layer_spec
from megarlhf.parallel import launch_local
from megarlhf.parallel.device import accelerator_available
from megarlhf.parallel.mesh import started_by_launcher
from megarlhf.parallel.mesh import DistEnv
from megarlhf.sft.config import DPOConfig, RMConfig, SFTConfig, StageConfig
from megarlhf.configio import load_config
from megarlhf.sft.loop import Plan, plan
from megarlhf.sft.dpo import dpo_stage, run_dpo
from megarlhf.sft.rm import rm_stage, run_rm
from megarlhf.sft.sft import run_sft, sft_stage

STAGES = {"sft": (SFTConfig, sft_stage, run_sft), "rm": (RMConfig, rm_stage, run_rm),
          "dpo": (DPOConfig, dpo_stage, run_dpo)}


def main(stage: str, config_path: str, overrides: list[str], nproc: int | None, *,
         dry_run: bool = False) -> dict:
    config_cls, make_stage, run = STAGES[stage]
    cfg = load_config(config_cls, config_path, overrides)
    if dry_run:
        print(describe(stage, cfg, plan(cfg, functools.partial(make_stage, cfg)), nproc))
        return {}
    if nproc is None:
        return run(cfg)
    if started_by_launcher():
        raise ValueError("--nproc spawns its own ranks; leave it out under torchrun or srun")
    # Data, tokenizer, layout and resume problems surface here as one plain error, not as a
    # traceback from each spawned rank.
    check_layout(cfg, plan(cfg, functools.partial(make_stage, cfg)), nproc)
    # A training run has no natural time limit; the launcher's default is meant for tests.
    return launch_local(run, nproc, cfg, timeout_s=math.inf)[0]


def describe(stage: str, cfg: StageConfig, checked: Plan, nproc: int | None) -> str:
    """`--dry-run`: the layout checked against the model and the world size (the ranks --nproc
    would spawn, or torchrun's / srun's), and what the run would do."""
    world = nproc if nproc is not None else DistEnv.detect().world_size
    dp, micro = check_layout(cfg, checked, world)
    start = f"resuming from {checked.resume_from}" if checked.resume_from else "from step 0"
    budget = cfg.train.max_tokens_per_micro_batch
    batching = (f"micro-batches of up to {budget} tokens" if budget else
                f"{micro} micro-batch(es) of {cfg.train.micro_batch_size}")
    return (f"dry run: would train {stage} for {cfg.train.steps} steps ({start}) on {world} "
            f"rank(s) at {cfg.parallel.describe(dp)}, {batching} per step; "
            f"{len(checked.examples.train)} training examples; model "
            f"{checked.model.num_layers} layers, hidden {checked.model.hidden_size}; outputs in "
            f"{cfg.train.output_dir}")


def check_layout(cfg: StageConfig, checked: Plan, world: int) -> tuple[int, int]:
    """(DP size, micro-batches per step) of the layout on `world` ranks; ValueError if the
    model's heads, layers or vocabulary, the world size or the batch do not divide."""
    checked.model.check_parallel(cfg.parallel, training=True)
    if cfg.train.profile and (refusal := profiling.cuda_refusal()):
        raise ValueError(refusal)
    # The layer spec the ranks will resolve (te needs a GPU and runs without CP).
    resolve_layer_spec(cfg.model.layer_spec, on_gpu=accelerator_available(),
                       context_parallel=cfg.parallel.context_parallel)
    dp = cfg.parallel.data_parallel_size(world)
    return dp, cfg.train.num_microbatches(dp)
