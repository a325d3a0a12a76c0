"""Bad records: stop at the first one, or skip it and count it, so that a dataset problem is
either an error or a number in the run's report, never a silently wrong batch."""

from __future__ import annotations

import collections

from megarlhf.data.config import BAD_RECORD_POLICIES

EXAMPLES_KEPT = 5


class BadRecordError(ValueError):
    """A bad record under the 'error' policy."""


class BadRecords:
    def __init__(self, policy: str, *, field: str = "data.on_bad_record"):
        """`field`: the config field that sets the policy, named in the error's fix."""
        if policy not in BAD_RECORD_POLICIES:
            raise ValueError(f"on_bad_record must be one of {BAD_RECORD_POLICIES}, got "
                             f"{policy!r}")
        self.policy, self.field = policy, field
        self.counts: collections.Counter[str] = collections.Counter()
        self.examples: list[str] = []
        self.truncated: collections.Counter[str] = collections.Counter()
        """Records kept but cut to fit (not bad): 'prompt' and 'response' counts."""

    def add(self, where: str, reason: str, detail: str = "") -> None:
        """Report a bad record at `where` (file:line or file:row); `reason` is the counted
        category, `detail` says more about this one."""
        message = f"{where}: {reason}" + (f" ({detail})" if detail else "")
        if self.policy == "error":
            raise BadRecordError(f"bad record {message}; fix the data or set "
                                 f"{self.field}=skip to drop such records")
        self.counts[reason] += 1
        if len(self.examples) < EXAMPLES_KEPT:
            self.examples.append(message)

    @property
    def skipped(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> dict:
        """JSON-ready counts for the console and the metrics file."""
        return {"skipped": self.skipped, "reasons": dict(sorted(self.counts.items())),
                "examples": list(self.examples), "truncated": dict(sorted(self.truncated.items()))}
