"""Appending a benchmark result to BENCHMARKS.md: dated title, machine, exact command, body."""

from __future__ import annotations

import datetime
import os
import platform


def machine(extra: str = "") -> str:
    ram_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (f"{os.cpu_count()}-core {platform.machine()} CPU, {ram_gib:.0f} GiB, "
            f"{platform.system()}" + (f", {extra}" if extra else ""))


def append_entry(path: str, title: str, command: str, body: str, *,
                 machine_extra: str = "") -> None:
    with open(path, "a") as f:
        f.write(f"\n## {datetime.date.today()} {title}\n\n"
                f"Machine: {machine(machine_extra)}; command: `{command}`\n\n{body}\n")
