"""The `megarlhf` command."""

from __future__ import annotations

import argparse


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="megarlhf", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="train a tiny model at TP2 x PP2 on 4 local CPU ranks")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from megarlhf import demo

        demo.main()


if __name__ == "__main__":
    main()
