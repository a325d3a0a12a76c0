"""Where a step's time goes (`profile: true`): torch.profiler around each phase a rank runs,
a Chrome trace per rank and phase call, and a table per phase.

A rank's `PhaseProfiler` is off until `start(step)`; then every `phase(name)` block records its
own profile, writes `<out_dir>/profile/step_<N>/<phase>_<call>_<group>_rank<R>.json` (open in
chrome://tracing or https://ui.perfetto.dev) and adds its operators to the phase's table, which
`take()` returns and clears. A phase called more than once in a step (rollout rounds, the
turns of multi-turn episodes) sums over its calls.

A table (`_Tally`) splits the phase's wall time into the operators' own (self) times, by
category, and what is left: time outside any torch operator, which is Python, the host's
bookkeeping and waiting on other processes (a rank ahead of its peers waits inside the
collective, so that wait counts as communication). Categories go by operator name
(`CATEGORIES`): on CPU both attention's softmax and the vocabulary's log-softmax land in
"softmax/logprob"; elementwise work (norms, activations, the logprob's arithmetic) is
"other".

On a GPU rank the profile also records CUDA activity: each operator's own kernels' device time
goes to the operator's category, so the table also splits the kernels' busy time ("device_s")
by category, and the trace shows the kernels under the operators that launched them. Every
phase a GPU rank runs, profiled or not, is an NVTX range of the phase's name, for Nsight
Systems.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager

import torch

_COMMUNICATION = ("c10d::", "gloo", "nccl", "all_reduce", "allreduce", "all_gather",
                  "allgather", "reduce_scatter", "broadcast", "barrier", "all_to_all",
                  # megatron-core's autograd functions around collectives wait inside them
                  "parallelregion")
CATEGORIES: tuple[tuple[str, frozenset[str], tuple[str, ...]], ...] = (
    ("communication", frozenset(), _COMMUNICATION),
    ("optimizer", frozenset(), ("optimizer.", "adam", "_foreach_")),
    ("matmul", frozenset({"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
                          "aten::_addmm_activation", "aten::linear", "aten::matmul",
                          "aten::mv", "aten::addmv", "aten::dot"}), ()),
    ("attention", frozenset(), ("scaled_dot_product", "flash_attention",
                                "efficient_attention")),
    ("softmax/logprob", frozenset(), ("softmax", "logsumexp", "cross_entropy", "nll_loss")),
    ("data movement", frozenset({
        "aten::copy_", "aten::to", "aten::_to_copy", "aten::cat", "aten::stack",
        "aten::index", "aten::index_put_", "aten::clone", "aten::contiguous", "aten::gather",
        "aten::scatter", "aten::scatter_", "aten::fill_", "aten::zero_", "aten::zeros",
        "aten::empty", "aten::empty_strided", "aten::pad", "aten::constant_pad_nd",
        "aten::masked_select", "aten::nonzero", "aten::where"}), ()),
)
"""(category, operator names, lower-case name substrings): the first match wins, and
"other" is the rest. An elementwise or data-movement operator inside a communication or
optimizer range (a collective's autograd function, `Optimizer.step`) counts as that range's."""
_SCOPES = frozenset({"communication", "optimizer"})
_KEPT = frozenset({"matmul", "attention", "softmax/logprob"})
"""Categories an operator keeps inside a scope."""
TOP = 12
"""Operators listed per phase, by self time."""


def category(op: str) -> str:
    lower = op.lower()
    for name, names, substrings in CATEGORIES:
        if op in names or any(m in lower for m in substrings):
            return name
    return "other"


def _categories(events) -> list[str]:
    """Each event's category: its own name's, or an enclosing scope's (_SCOPES)."""
    memo: dict[int, str | None] = {}

    def scope(event) -> str | None:  # the scope an event and its children are in
        key = id(event)
        if key not in memo:
            own = category(event.name)
            memo[key] = own if own in _SCOPES else (
                scope(event.cpu_parent) if event.cpu_parent is not None else None)
        return memo[key]

    # A matmul inside a collective's autograd function (a linear layer's with its
    # gradient's all-reduce) stays a matmul.
    return [own if own in _KEPT else (scope(e) or own)
            for e, own in ((e, category(e.name)) for e in events)]


def _by_seconds(seconds: dict[str, float]) -> dict[str, float]:
    return dict(sorted(seconds.items(), key=lambda kv: -kv[1]))


class _Tally:
    """A phase's seconds over its calls in a step: wall, operator self time (host) and the
    device time of each operator's own kernels, by category and by operator (every operator,
    so that a phase called many times, as generation is per turn of multi-turn episodes, ranks
    its operators over all calls)."""

    def __init__(self):
        self.wall_s = 0.0
        self.categories: dict[str, float] = {}
        self.device: dict[str, float] = {}
        self.ops: dict[str, list] = {}  # name -> [calls, self seconds, device seconds]

    def add(self, events, wall_s: float, skip: frozenset[str]) -> None:
        """One call's torch.profiler events (`prof.events()`); `skip`: the phase's own
        record_function range."""
        from torch.autograd import DeviceType

        self.wall_s += wall_s
        # Kernels are events of their own as well as the `kernels` of the operator that
        # launched them: counted once, through their operator.
        host = [e for e in events if e.device_type == DeviceType.CPU]
        for event, kind in zip(host, _categories(host)):
            if event.name in skip:
                continue
            seconds = event.self_cpu_time_total / 1e6
            device = sum(kernel.duration for kernel in event.kernels) / 1e6
            self.categories[kind] = self.categories.get(kind, 0.0) + seconds
            if device:
                self.device[kind] = self.device.get(kind, 0.0) + device
            row = self.ops.setdefault(event.name, [0, 0.0, 0.0])
            row[0] += 1
            row[1] += seconds
            row[2] += device

    def table(self) -> dict:
        """Wall seconds, the operators' own seconds by category, the time outside operators
        ("host_s"), and the top operators by self time. With kernels (a GPU rank) also their
        device seconds by category ("device_s", "device_categories"), and the top operators
        by device time."""
        inside = sum(self.categories.values())
        order = 2 if self.device else 1
        top = sorted(self.ops.items(), key=lambda kv: -kv[1][order])[:TOP]
        table = {"wall_s": self.wall_s, "operators_s": inside,
                 "host_s": max(0.0, self.wall_s - inside),
                 "categories": _by_seconds(self.categories),
                 "top": [{"op": op, "calls": calls, "self_s": seconds}
                         for op, (calls, seconds, _) in top]}
        if self.device:
            table["device_s"] = sum(self.device.values())
            table["device_categories"] = _by_seconds(self.device)
            for row, (_, (_, _, device)) in zip(table["top"], top):
                row["device_s"] = device
        return table


def _shares(seconds: dict[str, float]) -> str:
    return ", ".join(f"{c} {s:.2f}" for c, s in seconds.items() if s >= 0.005)


def format_tables(step: int, who: str, tables: dict[str, dict]) -> str:
    """The console's view of one rank's tables."""
    lines = [f"profile of step {step}, {who}:"]
    for phase, t in tables.items():
        lines.append(f"  {phase}: wall {t['wall_s']:.2f} s = operators {t['operators_s']:.2f}"
                     f" ({_shares(t['categories'])}) + outside operators {t['host_s']:.2f}")
        if "device_s" in t:
            lines.append(f"    kernels {t['device_s']:.2f} s on the device "
                         f"({_shares(t['device_categories'])})")
        lines += [f"    {row['self_s']:8.3f} s {row['calls']:6d}x  {row['op']}"
                  + (f"  (device {row['device_s']:.3f} s)" if "device_s" in row else "")
                  for row in t["top"][:5]]
    return "\n".join(lines)


class PhaseProfiler:
    """One rank's profiles of the phases of the steps it is told to profile."""

    def __init__(self, out_dir: str, who: str):
        """`who`: the rank's name in trace files ("<group>_rank<R>")."""
        self.out_dir, self.who = out_dir, who
        self.step: int | None = None
        self._tallies: dict[str, _Tally] = {}
        self._calls: dict[str, int] = {}

    def start(self, step: int) -> None:
        self.step, self._tallies, self._calls = step, {}, {}

    def take(self) -> dict[str, dict]:
        """The step's tables (phase -> table), and profiling off until the next start."""
        tables = {phase: tally.table() for phase, tally in self._tallies.items()}
        self.step, self._tallies = None, {}
        return tables

    @contextmanager
    def phase(self, name: str):
        # A rank that runs on the GPU (a CPU rank on a GPU machine records no kernels).
        cuda = torch.cuda.is_initialized()
        with _nvtx(name, cuda):
            if self.step is None:
                yield
                return
            with self._profiled(name, cuda):
                yield

    @contextmanager
    def _profiled(self, name: str, cuda: bool):
        from torch.profiler import ProfilerActivity, profile, record_function

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            start = time.perf_counter()
            with record_function(name):
                yield
            if cuda:  # the phase's wall time includes its last kernels
                torch.cuda.synchronize()
            wall = time.perf_counter() - start
        self._calls[name] = call = self._calls.get(name, 0) + 1
        directory = os.path.join(self.out_dir, "profile", f"step_{self.step}")
        os.makedirs(directory, exist_ok=True)
        prof.export_chrome_trace(os.path.join(directory, f"{name}_{call}_{self.who}.json"))
        self._tallies.setdefault(name, _Tally()).add(prof.events(), wall, frozenset({name}))


@contextmanager
def _nvtx(name: str, cuda: bool):
    if not cuda:
        yield
        return
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


def config_problems(profile: bool, profile_steps: tuple[int, ...] | None, steps: int,
                    prefix: str = "") -> list[str]:
    """A config's `profile` / `profile_steps` problems (`prefix`: the fields' section)."""
    problems = []
    if profile_steps is not None and not profile:
        problems.append(f"{prefix}profile_steps is set but {prefix}profile=false: set "
                        f"{prefix}profile=true")
    outside = [s for s in profile_steps or () if not 1 <= s <= steps]
    if outside:
        problems.append(f"{prefix}profile_steps {outside} are not steps of this run "
                        f"(1..{steps})")
    return problems


def profiled(profile: bool, profile_steps: tuple[int, ...] | None, step: int) -> bool:
    """Whether a run with these settings profiles step `step` (profile_steps None: all)."""
    return profile and (profile_steps is None or step in profile_steps)


def cuda_refusal() -> str | None:
    """Why SFT/RM's `train.profile` cannot run here: a GPU run has checked the profiler's CUDA
    tables and traces through PPO's phases (bench/gpu, item 8), not through SFT's loop."""
    if torch.cuda.is_available():
        return ("train.profile=true: SFT/RM profiling has not run on a GPU yet (PPO's "
                "profile has); profile on a CPU run or set train.profile=false")
    return None
