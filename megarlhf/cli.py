"""The `megarlhf` command."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="megarlhf", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="train a tiny model at TP2 x PP2 on 4 local CPU ranks")
    ppo = sub.add_parser("ppo", help="PPO / GRPO / RLOO / REINFORCE++ training")
    ppo.add_argument("--config", required=True,
                     help="recipe: a YAML file of PPOConfig fields, or module:function")
    ppo.add_argument("overrides", nargs="*", help="key=value settings on top of the recipe")
    args = parser.parse_args(argv)
    if args.command == "ppo":
        from megarlhf.ppo.controller import main as ppo_main

        try:
            ppo_main(args.config, args.overrides)
        except ValueError as e:
            parser.exit(2, f"error: {e}\n")
    if args.command == "demo":
        from megarlhf import demo

        demo.main()


if __name__ == "__main__":
    main()
