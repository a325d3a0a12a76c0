"""The PPO run's out_dir as the controller finds and keeps it, before any rank starts:

- claimed: creatable, writable, and held by one live run at a time (an flock on
  out_dir/.megarlhf.lock, released by the kernel when the holder dies, so a requeued job never
  writes beside the original still running, and a killed one never blocks its successor);
- matched: a resumed run must have the inputs the checkpoint was trained with (actor, critic
  and reward checkpoints, prompts, seed, algorithm), else it would continue the old policy
  against a new reference; `resume_allow_changes` names the ones changed on purpose.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import socket

from megarlhf.engine.checkpoint import (COMPLETE_MARKER, HF_SIDECAR, check_resumed_adapters,
                                       is_complete)
from megarlhf.integrity import sample_weights
from megarlhf.models.peft_format import CONFIG_FILE, WEIGHTS_FILE
from megarlhf.ppo import checkpoints
from megarlhf.ppo.config import LAYOUT_KEYS, RESUME_INPUTS, TRAINED_ROLES

log = logging.getLogger(__name__)

LOCK = ".megarlhf.lock"


class Claim:
    """out_dir held for this process until `release` (or its death)."""

    def __init__(self, out_dir: str):
        check_out_dir(out_dir)
        os.makedirs(out_dir, exist_ok=True)
        self._file = _locked(out_dir, "a+")
        self._file.seek(0)
        self._file.truncate()
        self._file.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        self._file.flush()

    def release(self) -> None:
        self._file.close()  # closing drops the flock


def check_out_dir(out_dir: str) -> None:
    """ValueError unless out_dir is (or can be made) a writable directory no live run holds.
    Changes nothing (the dry run calls it too)."""
    existing = out_dir
    while not os.path.exists(existing):
        existing = os.path.dirname(os.path.abspath(existing))
    if not os.path.isdir(existing):
        raise ValueError(f"out_dir {out_dir}: {existing} is a file, not a directory; choose "
                         f"another out_dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"out_dir {out_dir}: {existing} is not writable; choose another "
                         f"out_dir or fix its permissions")
    if os.path.isfile(os.path.join(out_dir, LOCK)):
        _locked(out_dir, "r").close()


def _locked(out_dir: str, mode: str):
    """out_dir's lock file opened in `mode` and flock'ed; ValueError if a live run holds it."""
    file = open(os.path.join(out_dir, LOCK), mode)
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.seek(0)
        holder = file.read().strip() or "another process"
        file.close()
        raise ValueError(f"out_dir {out_dir} is in use by a live run ({holder}); wait for it "
                         f"to end or choose another out_dir") from None
    return file


def resume_point(config, inputs: dict) -> tuple[str | None, dict | None]:
    """(latest checkpoint, its controller state) of out_dir, or (None, None) for a new run;
    ValueError if the checkpoint was trained with other inputs (check_resume)."""
    latest = checkpoints.of_run(config.out_dir).latest()
    if latest is None:
        return None, None
    state = checkpoints.read_state(latest)
    check_resume(latest, state.get("inputs"), inputs, config.resume_allow_changes)
    for role in TRAINED_ROLES:
        if role in config.roles and is_complete(os.path.join(latest, role)):
            check_resumed_adapters(os.path.join(latest, role), config.lora_of(role),
                                   f"layout.{LAYOUT_KEYS[role]}.lora",
                                   base=getattr(config, role), base_field=role)
    return latest, state


def run_inputs(config, prompts) -> dict:
    """What a checkpoint records about the inputs it was trained with. `prompts`: the run's
    training prompts as tokenized (so another tokenizer, template or field mapping of the same
    file counts as other prompts)."""
    inputs = {"seed": config.seed, "algorithm": config.algorithm,
              "prompts": _prompts_fingerprint(config.prompts, prompts)}
    for field in ("actor", "critic", "reward_model"):
        path = getattr(config, field)
        inputs[field] = None if path is None else _checkpoint_fingerprint(path)
    inputs["teacher"] = None if config.teacher is None else _teacher_fingerprint(config.teacher)
    inputs["teacher_by_source"] = _teachers_fingerprint(config.teacher_by_source)
    # The reference is rebuilt from it on a resume.
    adapter = config.reference_adapter
    inputs["actor_adapter"] = None if adapter is None else _files_fingerprint(
        adapter.from_peft, (CONFIG_FILE, WEIGHTS_FILE))
    judge = config.reward_judge
    inputs["reward_judge"] = None if judge is None else _judge_fingerprint(judge)
    return inputs


def check_resume(checkpoint: str, recorded: dict | None, now: dict,
                 allowed: tuple[str, ...]) -> None:
    """ValueError listing every input that differs from the checkpoint's (unless allowed)."""
    if recorded is None:  # written before inputs were recorded
        log.warning("%s does not record its run's inputs; resuming unchecked", checkpoint)
        return
    diffs = [f"{key}: checkpoint {_show(recorded.get(key))} vs now {_show(now[key])}"
             for key in RESUME_INPUTS
             if key not in allowed and _identity(recorded.get(key)) != _identity(now[key])]
    if diffs:
        raise ValueError(
            f"out_dir holds a run trained with other inputs, so resuming from {checkpoint} "
            f"would mix them:\n  " + "\n  ".join(diffs) + "\n  to continue anyway, set "
            f"resume_allow_changes=[{','.join(d.split(':')[0] for d in diffs)}]; for a new "
            f"run choose another out_dir")


def _identity(entry):
    """What must match: contents, not where they are (a moved checkpoint is the same one)."""
    return entry.get("sha256") if isinstance(entry, dict) else entry


def _show(entry) -> str:
    if isinstance(entry, dict):
        return f"{entry['path']} ({entry['sha256'][:12]})"
    return repr(entry)


def _prompts_fingerprint(path: str, prompts) -> dict:
    digest = hashlib.sha256()
    for p in prompts:
        digest.update(json.dumps([list(p.ids), p.ground_truth, p.data_source],
                                 default=str).encode() + b"\n")
    return {"path": os.path.abspath(path), "sha256": digest.hexdigest()}


def _checkpoint_fingerprint(path: str) -> dict:
    """A checkpoint's metadata (its completion marker and DCP's .metadata), not its weights:
    every save writes new metadata, so two checkpoints never share one."""
    return _files_fingerprint(path, (COMPLETE_MARKER, ".metadata"))


_JUDGE_FILES = ("config.json", "generation_config.json", "tokenizer.json",
                "tokenizer_config.json", "chat_template.jinja", "model.safetensors.index.json")


def _judge_fingerprint(judge) -> dict:
    """The judge by what decides its scores: its template's text, its config and tokenizer
    files, and each safetensors file's header (names, shapes, dtypes) with the first and last
    MiB of its data (integrity.sample_weights).
    A Megatron checkpoint: its metadata (_checkpoint_fingerprint) and its hf/ sidecar's
    tokenizer files."""
    digest = hashlib.sha256()
    with open(judge.template, "rb") as f:
        digest.update(b"template\0" + f.read())
    if not os.path.isfile(os.path.join(judge.model, "config.json")):
        for part in (_checkpoint_fingerprint(judge.model),
                     _files_fingerprint(os.path.join(judge.model, HF_SIDECAR), _JUDGE_FILES)):
            digest.update(part["sha256"].encode())
        return {"path": os.path.abspath(judge.model), "sha256": digest.hexdigest()}
    _hf_digest(digest, judge.model)
    return {"path": os.path.abspath(judge.model), "sha256": digest.hexdigest()}


def _hf_digest(digest, hf_dir: str) -> None:
    """Add an HF model directory to `digest`: its config and tokenizer files, and each
    safetensors file's header (names, shapes, dtypes) with the first and last MiB of its data
    (integrity.sample_weights)."""
    digest.update(_files_fingerprint(hf_dir, _JUDGE_FILES)["sha256"].encode())
    for name in sorted(n for n in os.listdir(hf_dir) if n.endswith(".safetensors")):
        file = os.path.join(hf_dir, name)
        with open(file, "rb") as f:
            header = f.read(8)
            header += f.read(int.from_bytes(header, "little"))
        digest.update(name.encode() + b"\0" + header)
        sample_weights(digest, file, start=len(header))


def _teacher_fingerprint(path: str) -> dict:
    """A teacher: a checkpoint by its metadata (_checkpoint_fingerprint), an HF directory as
    _hf_digest reads it (told apart as the worker loads it: a complete checkpoint first)."""
    if is_complete(path):
        return _checkpoint_fingerprint(path)
    digest = hashlib.sha256()
    _hf_digest(digest, path)
    return {"path": os.path.abspath(path), "sha256": digest.hexdigest()}


def _teachers_fingerprint(by_source: dict[str, str]) -> dict | None:
    """teacher_by_source as one input: each source with its teacher's fingerprint (a moved
    teacher is the same one; another source's, or another teacher, is not)."""
    if not by_source:
        return None
    parts = {source: _teacher_fingerprint(path) for source, path in sorted(by_source.items())}
    digest = hashlib.sha256(json.dumps({s: p["sha256"] for s, p in parts.items()}).encode())
    return {"path": ", ".join(f"{s}={p['path']}" for s, p in parts.items()),
            "sha256": digest.hexdigest()}


def _files_fingerprint(path: str, names: tuple[str, ...]) -> dict:
    """The directory `path` by the contents of its files `names`."""
    digest = hashlib.sha256()
    for name in names:
        file = os.path.join(path, name)
        if os.path.isfile(file):
            with open(file, "rb") as f:
                digest.update(name.encode() + b"\0" + f.read())
    return {"path": os.path.abspath(path), "sha256": digest.hexdigest()}
