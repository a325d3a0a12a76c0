"""5. A GRPO run through the controller on this machine's one device (Megatron rollouts, fp32).

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


def measure(sizes: Sizes, run) -> list[Row]:
    from megarlhf.models.presets import preset
    from megarlhf.ppo.config import PPOConfig
    from megarlhf.ppo.controller import run as run_ppo

    with tempfile.TemporaryDirectory() as root:
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
            rollout_backend="megatron", dtype="fp32")
        history = run_ppo(config)
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
