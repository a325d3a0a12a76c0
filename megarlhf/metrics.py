"""A run's metrics log, the same for every stage (SFT, RM, PPO), kept by one process (rank 0,
or the PPO controller): every record appended to out_dir/metrics.jsonl, a line on stdout, a
progress bar on an interactive terminal, and the optional dashboards: TensorBoard event files
in out_dir/tensorboard and a W&B run that a resumed job continues.

A record is a dict; one with a "step" is a step's metrics and goes to the dashboards too, under
"<split>/<name>" when it names a "split" (SFT / RM: train, eval). A record without a step (an
"event", e.g. the data report) goes to the JSONL file only.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import sys

log = logging.getLogger(__name__)

FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
"""A few of each step's prompts, responses and rewards, one JSON object per line."""
_LABELS = ("step", "split", "event")
"""Record fields that say what a record is rather than measure anything."""


class MetricsLog:
    def __init__(self, out_dir: str | None, *, name: str, steps: int, resumed_step: int = 0,
                 console_keys: tuple[str, ...] | None = None, tensorboard: bool = False,
                 wandb_project: str | None = None, run_config: dict | None = None):
        """`out_dir` None: this process logs nothing (every rank but 0). `name` heads every
        console line; `steps` is the run's total and `resumed_step` the step it continues from
        (0: a new run): what an earlier run logged after that step, before it was killed, is
        dropped from the JSONL file and hidden in TensorBoard, so no step is listed twice.
        `console_keys`: the metrics a step's console line shows (None: all of them)."""
        self.name, self._console_keys = name, console_keys
        self._file = self._tensorboard = self._wandb = self._bar = None
        if out_dir is None:
            return
        os.makedirs(out_dir, exist_ok=True)
        for name in (FILE, SAMPLES_FILE):
            _cut_after(os.path.join(out_dir, name), resumed_step)
        self._file = open(os.path.join(out_dir, FILE), "a")
        self._samples_path = os.path.join(out_dir, SAMPLES_FILE)
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tensorboard = SummaryWriter(os.path.join(out_dir, "tensorboard"),
                                              purge_step=resumed_step + 1)
        if wandb_project:
            self._wandb = _wandb_run(out_dir, wandb_project, run_config)
        if sys.stderr.isatty():  # batch logs get the console lines alone
            from tqdm import tqdm

            self._bar = tqdm(total=steps, initial=resumed_step, unit="step", desc=name,
                             dynamic_ncols=True)

    def write(self, record: dict, *, echo: bool = True) -> None:
        """Log `record`; `echo` False keeps it off the console."""
        if self._file is None:
            return
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if "step" in record:
            self._to_dashboards(record)
            self._advance(record)
        if echo:
            self._print(self._line(record))

    def samples(self, step: int, rows: list[dict]) -> None:
        """Append `rows` (each a sample's prompt, response, reward, ...) to samples.jsonl
        under `step`; the dashboards get them as a text table / W&B table."""
        if self._file is None or not rows:
            return
        rows = [{"step": step, **row} for row in rows]
        with open(self._samples_path, "a") as f:
            f.writelines(json.dumps(row, default=str) + "\n" for row in rows)
        columns = list(dict.fromkeys(k for row in rows for k in row))
        if self._tensorboard is not None:
            table = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n"
            table += "".join("| " + " | ".join(_cell(row.get(c)) for c in columns) + " |\n"
                             for row in rows)
            self._tensorboard.add_text("samples", table, step)
        if self._wandb is not None:
            import wandb

            self._wandb.log({"samples": wandb.Table(
                columns=columns, data=[[str(row.get(c)) for c in columns] for row in rows])},
                step=step)

    def phase(self, name: str) -> None:
        """Name the phase in progress on the progress bar."""
        if self._bar is not None:
            self._bar.set_description(f"{self.name} {name}")

    def note(self, text: str) -> None:
        if self._file is not None:
            self._print(f"{self.name}: {text}")

    def close(self) -> None:
        if self._file is None:
            return
        self._file.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._bar is not None:
            self._bar.close()

    def _to_dashboards(self, record: dict) -> None:
        step, split = record["step"], record.get("split")
        scalars = {f"{split}/{k}" if split else k: v for k, v in record.items()
                   if k not in _LABELS and isinstance(v, (int, float))
                   and not isinstance(v, bool)}
        if self._tensorboard is not None:
            for key, value in scalars.items():
                self._tensorboard.add_scalar(key, value, step)
            self._tensorboard.flush()
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def _advance(self, record: dict) -> None:
        """Move the bar to the record's step (SFT / RM log train and eval at the same step),
        showing its first console metric."""
        if self._bar is None or record["step"] <= self._bar.n:
            return
        shown = self._shown(record)
        if shown:
            self._bar.set_postfix({shown[0]: _fmt(record[shown[0]])}, refresh=False)
        self._bar.update(record["step"] - self._bar.n)

    def _shown(self, record: dict) -> list[str]:
        keys = self._console_keys or [k for k in record if k not in _LABELS]
        return [k for k in keys if k in record]

    def _line(self, record: dict) -> str:
        head = " ".join([self.name] + [str(record[k]) for k in ("split", "event")
                                       if k in record])
        if "step" in record:
            head += f" step {record['step']}"
        return " | ".join([head] + [f"{k} {_fmt(record[k])}" for k in self._shown(record)])

    def _print(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text, file=sys.stdout)  # above the bar, not through it
        else:
            print(text)
        sys.stdout.flush()


def _cell(value) -> str:
    """A markdown table cell: one line, pipes escaped."""
    return str(value).replace("|", "\\|").replace("\n", "\\n")


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3e}" if value and (abs(value) < 1e-3 or abs(value) >= 1e4) \
            else f"{value:.4f}"
    return str(value)


def _wandb_run(out_dir: str, project: str, run_config: dict | None):
    """A W&B run whose id is kept in out_dir, so a resumed job logs into the same run."""
    import wandb

    id_file = os.path.join(out_dir, "wandb_run_id")
    if os.path.isfile(id_file):
        with open(id_file) as f:
            run_id = f.read().strip()
    else:
        run_id = wandb.util.generate_id()
        with open(id_file + ".tmp", "w") as f:
            f.write(run_id)
        os.replace(id_file + ".tmp", id_file)
    return wandb.init(project=project, id=run_id, resume="allow", dir=out_dir,
                      config=run_config)


def missing_dashboards(tensorboard: bool, wandb_project: str | None) -> list[str]:
    """What a config asks to log to but cannot, for its checks before any rank starts."""
    return [f"{module} logging is on but {module} is not installed: pip install {module}"
            for flag, module in ((tensorboard, "tensorboard"), (wandb_project, "wandb"))
            if flag and importlib.util.find_spec(module) is None]


def read_metrics(out_dir: str) -> list[dict]:
    with open(os.path.join(out_dir, FILE)) as f:
        return [json.loads(line) for line in f if line.strip()]


def read_steps(out_dir: str) -> list[dict]:
    """The step records of out_dir/metrics.jsonl (events such as the data report left out)."""
    return [r for r in read_metrics(out_dir) if "step" in r]


def _cut_after(path: str, step: int) -> None:
    """Cut a JSONL log back to what was logged up to `step`: records of later steps go, and
    so does a line a kill cut short; records without a step stay."""
    if not os.path.isfile(path):
        return
    with open(path) as f:
        lines = f.readlines()
    kept = [line for line in lines if _logged_up_to(line, step)]
    if len(kept) == len(lines):
        return
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)
    log.info("%s: dropped %d line(s) logged after step %d (after the checkpoint the run "
             "continues from)", os.path.basename(path), len(lines) - len(kept), step)


def _logged_up_to(line: str, step: int) -> bool:
    try:
        record = json.loads(line)
        return int(record.get("step", 0)) <= step
    except (ValueError, AttributeError, TypeError):  # a line cut short by a kill
        return False
