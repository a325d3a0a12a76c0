"""PPO metrics sinks: TensorBoard event files and a W&B run that a resumed job continues."""

from __future__ import annotations

import sys
import types

import pytest

from megarlhf.ppo.metrics import MetricsLog, read_metrics

STEP = {"step": 3, "reward/mean": 0.5, "kl": 0.01, "skipped": 0.0}


def test_tensorboard_gets_every_numeric_metric(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLog(str(tmp_path), tensorboard=True)
    log.write(3, STEP)
    log.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert sorted(events.Tags()["scalars"]) == ["kl", "reward/mean", "skipped"]
    [point] = events.Scalars("reward/mean")
    assert (point.step, point.value) == (3, 0.5)
    assert read_metrics(str(tmp_path)) == [STEP]


def test_wandb_run_is_resumed_under_the_same_id(tmp_path, monkeypatch):
    """W&B itself is not installed in CI: a recording stand-in shows what we ask of it."""
    calls = []

    class Run:
        def log(self, scalars, step):
            calls.append(("log", step, scalars))

        def finish(self):
            calls.append(("finish",))

    ids = iter(["first-id", "second-id"])
    fake = types.SimpleNamespace(util=types.SimpleNamespace(generate_id=lambda: next(ids)),
                                 init=lambda **kw: calls.append(("init", kw)) or Run())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    for _ in range(2):  # a run and its resumption
        log = MetricsLog(str(tmp_path), wandb_project="demo", run_config={"steps": 6})
        log.write(3, STEP)
        log.close()
    inits = [c[1] for c in calls if c[0] == "init"]
    assert [i["id"] for i in inits] == ["first-id", "first-id"]
    assert all(i["resume"] == "allow" and i["project"] == "demo" for i in inits)
    assert ("log", 3, {"reward/mean": 0.5, "kl": 0.01, "skipped": 0.0}) in calls
