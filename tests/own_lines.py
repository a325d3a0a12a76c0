"""What megarlhf prints itself, to tell a run's own output from a library's (megarlhf/logs.py
keeps those at error level).

A run's own lines are exactly:
- its metrics log's console lines (megarlhf/metrics.py): `ppo step 3 | reward/mean 0.1 | ...`,
  `sft eval step 2 | ...`, `ppo: <note>` (the stage names ppo, sft, rm);
- its log records (megarlhf/logs.py): `warning: ...`, `error: ...` (a level in lower case);
- the JSON object `megarlhf ppo` prints last (the last step's metrics), whole.
A Ray worker's line counts as what it holds once Ray's colours, its `(_Rank pid=N)` prefix and
the `[repeated Nx across cluster] (...)` of its deduplication are taken off.
"""

from __future__ import annotations

import json
import re

OWN = re.compile(r"(ppo|sft|rm)( [\w/.-]+)*( step \d+)?( \| .+)?"
                 r"|(ppo|sft|rm): .+"
                 r"|(debug|info|warning|error|critical): .+")
COLOUR = re.compile(r"\x1b\[[\d;]*m")
RAY_PREFIX = re.compile(r"^\(\w+ pid=\d+(, ip=[\d.]+)?\) ")
RAY_REPEATED = re.compile(r"\s*\[repeated \d+x across cluster\].*$")


def _without_final_json(lines: list[str]) -> list[str]:
    for i, line in enumerate(lines):
        if line == "{":
            try:
                json.loads("\n".join(lines[i:]))
            except ValueError:
                continue
            return lines[:i]
    return lines


def foreign_lines(*outputs: str) -> list[str]:
    """The lines of `outputs` (a run's stdout, its stderr, ...) that megarlhf did not
    print; blank lines aside."""
    foreign = []
    for output in outputs:
        for line in _without_final_json(output.splitlines()):
            text = RAY_REPEATED.sub("", RAY_PREFIX.sub("", COLOUR.sub("", line), count=1))
            if text.strip() and not OWN.fullmatch(text):
                foreign.append(line)
    return foreign
