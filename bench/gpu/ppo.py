"""5. A GRPO run through the controller on this machine's one device (Megatron rollouts, fp32);
8. the same run with `profile: true` on its second step.

Everything a user's `megarlhf ppo` does runs here: the launching process checks the recipe,
one rank holds actor, reference and rollout engine, samples, scores, takes the old-logprob and
update passes and syncs the weights back into the engine. The row reports seconds per step
after the first (which holds CUDA's start-up) and the trainer-vs-engine logprob gap of every
step, which the run's own guard bounds: on a GPU it shows the engine and the trainer compute
the same logprobs there, not only on CPU.
"""

from __future__ import annotations

import json
import os
import tempfile

from bench.gpu.common import ONE_RANK, Row, random_prompts
from bench.gpu.plan import Sizes

LOW_IDS = 30
"""Token ids below this earn the reward: a learnable target with a known optimum (1.0)."""


def low_token_fraction(prompt_ids: list[int], response_ids: list[int]) -> float:
    return sum(t < LOW_IDS for t in response_ids) / max(len(response_ids), 1)


def write_actor(path: str, preset_name: str) -> None:
    """One rank: a model of the preset from seed 0, saved as a megarlhf checkpoint."""
    from megarlhf.engine.checkpoint import save_checkpoint
    from megarlhf.engine.train import TrainEngine
    from megarlhf.models.gpt import model_spec
    from megarlhf.models.presets import preset
    from megarlhf.parallel import init_mesh

    mesh = init_mesh(ONE_RANK, seed=0)
    engine = TrainEngine(model_spec(preset(preset_name), ONE_RANK), mesh)
    save_checkpoint(path, engine, mesh, with_optimizer=False)


def _grpo(root: str, sizes: Sizes, run, **fields):
    """(config, history) of the GRPO run in `root`."""
    from megarlhf.models.presets import preset
    from megarlhf.ppo.config import PPOConfig
    from megarlhf.ppo.controller import run as run_ppo

    actor = os.path.join(root, "actor")
    run(write_actor, actor, sizes.ppo_preset)
    prompts = os.path.join(root, "prompts.jsonl")
    with open(prompts, "w") as f:
        for ids in random_prompts(preset(sizes.ppo_preset).vocab_size, 16, 8):
            f.write(json.dumps({"prompt_ids": ids}) + "\n")
    config = PPOConfig(
        actor=actor, prompts=prompts, out_dir=os.path.join(root, "run"),
        reward_fn="bench.gpu.ppo:low_token_fraction", algorithm="grpo", nproc=1,
        steps=sizes.ppo_steps, prompts_per_step=4, samples_per_prompt=4,
        max_new_tokens=sizes.ppo_new_tokens, actor_lr=1e-3, seed=0,
        rollout_backend="megatron", dtype="fp32", **fields)
    return config, run_ppo(config)


def measure(sizes: Sizes, run) -> list[Row]:
    with tempfile.TemporaryDirectory() as root:
        config, history = _grpo(root, sizes, run)
    means = [m["rollout/logprob_gap_mean"] for m in history]
    maxima = [m["rollout/logprob_gap_max"] for m in history]
    later = [m["time/step"] for m in history[1:]] or [history[0]["time/step"]]
    setting = (f"{sizes.ppo_preset}, fp32, GRPO, 1 rank, {len(history)} steps of 4 prompts x 4 "
               f"samples x {sizes.ppo_new_tokens} tokens, Megatron rollouts")
    result = (f"{sum(later) / len(later):.2f} s/step (after the first); logprob gap mean "
              f"<= {max(means):.1e} (guard {config.gap_limits.mean:g}), max <= {max(maxima):.1e}; "
              f"reward "
              f"{history[0]['reward/mean']:.3f} -> {history[-1]['reward/mean']:.3f}")
    return [("", setting, result)]


DEVICE_EVENTS = ("kernel", "gpu_memcpy", "gpu_memset")
"""The trace's categories of device work (what an operator's `kernels` hold)."""


def _kernels(trace: str) -> tuple[int, float]:
    """(kernels, seconds of device work) in a Chrome trace."""
    with open(trace) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("cat") in DEVICE_EVENTS]
    return sum(e["cat"] == "kernel" for e in events), sum(e["dur"] for e in events) / 1e6


def measure_profile(sizes: Sizes, run) -> list[Row]:
    """Step 2 profiled: every phase's table splits the kernels' device time by category
    (within the phase's wall time, as one stream runs them one at a time), the update's
    matmuls and Adam run as kernels, and each phase's device time equals the sum of the
    device events' durations in its trace (1% or 10 us: the table sums the operators'
    kernels, the trace lists them; they differ only by device work no operator launched)."""
    import torch

    from megarlhf.metrics import read_metrics

    on_gpu = torch.cuda.is_available()  # a dry run on CPU records no kernels to check
    step = min(2, sizes.ppo_steps)
    with tempfile.TemporaryDirectory() as root:
        config, history = _grpo(root, sizes, run, profile=True, profile_steps=(step,))
        (event,) = [r for r in read_metrics(config.out_dir) if r.get("event") == "profile"]
        directory = os.path.join(config.out_dir, "profile", f"step_{step}")
        kernels = {name.split("_")[0]: _kernels(os.path.join(directory, name))
                   for name in sorted(os.listdir(directory))}
    rows, problems = [], []
    for phase, table in event["phases"].items():
        device = table.get("device_s", 0.0)
        shares = ", ".join(f"{c} {s * 1e3:.3f} ms" for c, s in
                           table.get("device_categories", {}).items() if s >= 1e-6)
        if on_gpu and not 0 < device <= table["wall_s"]:
            problems.append(f"{phase}: kernels {device:.4f} s outside (0, wall "
                            f"{table['wall_s']:.4f}]")
        count, traced = kernels[phase]
        if on_gpu and not count:
            problems.append(f"{phase}: no kernel in its trace")
        if abs(device - traced) > max(0.01 * traced, 1e-5):
            problems.append(f"{phase}: table {device:.6f} s vs trace {traced:.6f} s")
        rows.append((phase, f"wall {table['wall_s'] * 1e3:.1f} ms, host operators "
                     f"{table['operators_s'] * 1e3:.1f} ms",
                     f"kernels {device * 1e3:.1f} ms ({shares}); the trace: {count} "
                     f"kernels, device work {traced * 1e3:.1f} ms"))
    train = event["phases"]["train"].get("device_categories", {})
    if on_gpu and not (train.get("matmul", 0) > 0 and train.get("optimizer", 0) > 0):
        problems.append(f"train: no matmul or optimizer kernels ({train})")
    (profiled,) = [m["time/step"] for m in history if m["step"] == step]
    others = [m["time/step"] for m in history[1:] if m["step"] != step]
    rows.append(("cost", f"step {step} profiled, the other steps after the first not",
                 f"{profiled:.2f} s vs " + (f"{sum(others) / len(others):.2f} s per step"
                                             if others else "no other step")))
    if problems:
        rows.append(("check", "", "FAILED: " + "; ".join(problems)))
    return rows
