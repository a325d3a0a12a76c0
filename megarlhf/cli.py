"""The `megarlhf` command."""

from __future__ import annotations

import argparse
import os
import sys

from megarlhf import logs
from megarlhf.errors import run_command


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="megarlhf", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    demo_cmd = sub.add_parser("demo", help="tokenizer, SFT, reward model and PPO on embedded "
                                           "data, 4 local CPU ranks")
    demo_cmd.add_argument("--out", default="demo_out",
                          help="output directory (a previous demo's is replaced)")
    ppo = sub.add_parser("ppo", help="PPO / GRPO / RLOO / REINFORCE++ training")
    ppo.add_argument("--config", required=True,
                     help="recipe: a YAML file of PPOConfig fields, or module:function")
    ppo.add_argument("overrides", nargs="*", help="key=value settings on top of the recipe")
    data = sub.add_parser("data", help="preview a PPO recipe's prompt datasets as the run "
                                       "will see them; optionally write a tokenized cache")
    data.add_argument("--config", required=True, help="PPO recipe (as for `megarlhf ppo`)")
    data.add_argument("--show", type=int, default=3, help="prompts shown per dataset")
    data.add_argument("--write-cache", metavar="FILE",
                      help="write the tokenized prompts of --dataset to FILE")
    data.add_argument("--dataset", choices=("prompts", "val_prompts"), default="prompts")
    data.add_argument("overrides", nargs="*", help="key=value settings on top of the recipe")
    plan = sub.add_parser("plan", help="check a PPO recipe against a cluster and estimate "
                                       "memory per GPU; exit 1 if it does not fit")
    plan.add_argument("--config", required=True, help="PPO recipe (as for `megarlhf ppo`); "
                      "a model path may be preset:NAME (megarlhf.models.presets)")
    plan.add_argument("--nodes", type=int, required=True)
    plan.add_argument("--gpus-per-node", type=int, default=8)
    plan.add_argument("--gpu-mem-gb", type=float, default=80.0, help="GiB per GPU")
    plan.add_argument("--host-mem-gb", type=float, default=2048.0,
                      help="GiB of host memory per node (offloaded state is pinned there)")
    plan.add_argument("--prompt-len", type=int, default=None,
                      help="tokens of the longest prompt (default: measured in the prompts file)")
    plan.add_argument("overrides", nargs="*", help="key=value settings on top of the recipe")
    stages = []
    for name, help in (("sft", "supervised fine-tuning (stage 1)"),
                       ("rm", "pairwise reward-model training (stage 2)"),
                       ("dpo", "offline preference optimization (DPO, IPO, SimPO on pairs; KTO)")):
        stage = sub.add_parser(name, help=help)
        stages.append(stage)
        stage.add_argument("--config", required=True, help="YAML file of SFTConfig / RMConfig / "
                           "DPOConfig")
        stage.add_argument("--nproc", type=int, default=None,
                           help="spawn this many local ranks (instead of torchrun / srun)")
        stage.add_argument("overrides", nargs="*", metavar="key=value",
                           help="dotted overrides, e.g. train.steps=100 parallel.tensor_parallel=2")
    for with_dry_run in (ppo, plan, *stages):
        with_dry_run.add_argument("--dry-run", action="store_true",
                             help="check the config, layout and paths, print what would run, "
                                  "and stop (no model is built, no process started)")
    plot = sub.add_parser("plot", help="a run's metrics.jsonl as PNG curves")
    plot.add_argument("run_dir")
    plot.add_argument("--out", help="PNG path (default RUN_DIR/curves.png)")
    args = parser.parse_args(argv)
    # module:function fields (reward_fn, a recipe) name modules beside the user's files, as
    # `python -m megarlhf.cli` finds them; the installed `megarlhf` script's sys.path holds only
    # its own bin/ directory. Spawned ranks and reward workers inherit sys.path.
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    sys.exit(run_command(_run, args))


def _run(args: argparse.Namespace) -> int:
    logs.check()
    if args.command == "plot":
        from megarlhf.ppo.plot import plot_run

        print(plot_run(args.run_dir, args.out))
    elif args.command in ("sft", "rm", "dpo"):
        from megarlhf.sft import command

        command.main(args.command, args.config, args.overrides, args.nproc,
                     dry_run=args.dry_run)
    elif args.command == "ppo":
        from megarlhf.plan import dryrun
        from megarlhf.configio import load_config
        from megarlhf.ppo.config import PPOConfig
        from megarlhf.ppo.controller import main as ppo_main

        if args.dry_run:
            print(dryrun.ppo(load_config(PPOConfig, args.config, args.overrides)))
        else:
            ppo_main(args.config, args.overrides)
    elif args.command == "data":
        from megarlhf.ppo import data_command

        return data_command.main(args.config, args.overrides, show=args.show,
                                 write_cache=args.write_cache, dataset=args.dataset)
    elif args.command == "plan":
        from megarlhf.plan import command as plan_command
        from megarlhf.plan.job import Cluster

        cluster = Cluster(nodes=args.nodes, gpus_per_node=args.gpus_per_node,
                          gpu_mem_gb=args.gpu_mem_gb, host_mem_gb=args.host_mem_gb)
        return plan_command.main(args.config, args.overrides, cluster,
                                 prompt_len=args.prompt_len, dry_run=args.dry_run)
    elif args.command == "demo":
        from megarlhf import demo

        demo.main(args.out)
    return 0

if __name__ == "__main__":
    main()
