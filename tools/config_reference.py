"""Write docs/reference/config.md from the config dataclasses (megarlhf/config_reference.py);
with --check, exit 1 if the file is not what they generate.

    python -m tools.config_reference [--check]
"""

from __future__ import annotations

import argparse
import os
import sys

from megarlhf.config_reference import render

PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs",
                    "reference", "config.md")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="only check that the file is up to date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        with open(PATH, encoding="utf-8") as f:
            if f.read() != text:
                print(f"error: {PATH} is out of date: run python -m tools.config_reference",
                      file=sys.stderr)
                return 1
        return 0
    tmp = PATH + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, PATH)
    print(f"wrote {PATH}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
