"""The metrics log every stage keeps (megarlhf/metrics.py): TensorBoard event files, a W&B run
that a resumed job continues, and a resumed run's log continuing where its checkpoint was."""

from __future__ import annotations

import sys
import types

import pytest

from megarlhf.metrics import MetricsLog, read_metrics

STEP = {"step": 3, "reward/mean": 0.5, "kl": 0.01, "skipped": 0.0}


def tensorboard_scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return {tag: [(p.step, p.value) for p in events.Scalars(tag)]
            for tag in events.Tags()["scalars"]}


def test_tensorboard_gets_every_numeric_metric(tmp_path):
    log = MetricsLog(str(tmp_path), name="ppo", steps=6, tensorboard=True)
    log.write(STEP)
    log.close()
    assert tensorboard_scalars(tmp_path / "tensorboard") == {
        "kl": [(3, pytest.approx(0.01))], "reward/mean": [(3, 0.5)], "skipped": [(3, 0.0)]}
    assert read_metrics(str(tmp_path)) == [STEP]


def test_a_resumed_log_drops_and_hides_what_was_logged_after_its_checkpoint(tmp_path):
    """SFT / RM records name their split, which prefixes their dashboard names; events without
    a step (the data report) stay in the JSONL file only, and survive the cut."""
    def record(step, split, loss):
        return {"step": step, "split": split, "loss": loss, "update_skipped": True}

    log = MetricsLog(str(tmp_path), name="sft", steps=4, tensorboard=True)
    log.write({"event": "data", "train": {"kept": 9}}, echo=False)
    for step in (1, 2, 3):
        log.write(record(step, "train", float(step)))
    log.write(record(3, "eval", 30.0))
    log.close()
    # Resumed from the step-2 checkpoint: step 3 is trained (and logged) again.
    log = MetricsLog(str(tmp_path), name="sft", steps=4, resumed_step=2, tensorboard=True)
    log.write(record(3, "train", 0.5))
    log.close()
    logged = [(r.get("step"), r.get("split"), r.get("loss")) for r in read_metrics(str(tmp_path))]
    assert logged == [(None, None, None), (1, "train", 1.0), (2, "train", 2.0), (3, "train", 0.5)]
    assert tensorboard_scalars(tmp_path / "tensorboard") == {  # update_skipped: a bool, no scalar
        "train/loss": [(1, 1.0), (2, 2.0), (3, 0.5)], "eval/loss": []}


def test_the_console_shows_a_steps_metrics_and_other_ranks_print_nothing(tmp_path, capsys):
    log = MetricsLog(str(tmp_path / "ppo"), name="ppo", steps=6,
                     console_keys=("kl", "reward/mean"))
    log.write(STEP)
    log.write({**STEP, "step": 4}, echo=False)
    log.note("resumed")
    log.close()
    log = MetricsLog(str(tmp_path / "sft"), name="sft", steps=2)
    log.write({"step": 1, "split": "train", "loss": 2.0, "tokens": 7})
    log.close()
    assert capsys.readouterr().out.splitlines() == [
        "ppo step 3 | kl 0.0100 | reward/mean 0.5000", "ppo: resumed",
        "sft train step 1 | loss 2.0000 | tokens 7"]
    assert [r["step"] for r in read_metrics(str(tmp_path / "ppo"))] == [3, 4]
    silent = MetricsLog(None, name="sft", steps=6, tensorboard=True)
    silent.write(STEP)
    silent.note("resumed")
    silent.close()
    assert capsys.readouterr().out == ""


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
        log = MetricsLog(str(tmp_path), name="ppo", steps=6, wandb_project="demo",
                         run_config={"steps": 6})
        log.write(STEP)
        log.close()
    inits = [c[1] for c in calls if c[0] == "init"]
    assert [i["id"] for i in inits] == ["first-id", "first-id"]
    assert all(i["resume"] == "allow" and i["project"] == "demo" for i in inits)
    assert ("log", 3, {"reward/mean": 0.5, "kl": 0.01, "skipped": 0.0}) in calls
