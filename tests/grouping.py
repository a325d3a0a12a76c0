"""Several cases of a multi-process test in one launch per process count."""

from __future__ import annotations

from megarlhf.parallel import launch_local
from tests import workers


def selected_ids(request, test: str) -> set[str]:
    """The parameter ids of `test` (a test function's name) this session runs."""
    return {item.callspec.id for item in request.session.items
            if getattr(item, "originalname", None) == test and hasattr(item, "callspec")}


def grouped_launches(cases: dict, wanted: set | None = None):
    """Look up per-rank results of named cases {name: (nprocs, fn, args, kwargs)}: the first
    look-up of a case runs, in one launch, every case of its process count that is `wanted`
    (default: all), one after the other, each building its own mesh and engine as a launch of
    its own would. A 4-rank launch costs ~13 s of process start-up on a 2-core machine, so the
    same comparisons run for a fraction of it; a session that selects one case runs only
    that one."""
    cache: dict = {}

    def get(name):
        if name not in cache:
            nprocs = cases[name][0]
            group = [n for n in cases if cases[n][0] == nprocs
                     and (n == name or wanted is None or n in wanted)]
            per_rank = launch_local(workers.in_sequence, nprocs,
                                    [cases[n][1:] for n in group])
            for i, n in enumerate(group):
                cache[n] = [outs[i] for outs in per_rank]
        return cache[name]
    return get
