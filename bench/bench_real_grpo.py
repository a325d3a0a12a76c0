"""GRPO step time on a real pretrained model (SmolLM2-135M-Instruct, 30 layers, tied
embeddings; the real-model tier's, from tests/real_model.py), per phase, with vLLM and Megatron
rollouts side by side in one run.

Setup: the tier's capital-city task (chat-message rows, templated by the run), 4 prompts x 4
samples of up to 24 new tokens per step (samples stop at <|im_end|>), fp32, 2 colocated local
ranks (DP2; vLLM: one TP1 engine per rank). Each backend is one `run()` of `--steps` steps;
the first step (start-up effects) is dropped and medians of the others reported.

    python -m bench.bench_real_grpo [--steps 4] [--append BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

from bench.report import append_entry
from megarlhf.convert.hf_to_mcore import hf_to_mcore
from megarlhf.parallel.mesh import ParallelConfig
from megarlhf.ppo.config import PPOConfig
from megarlhf.ppo.controller import run
from tests import real_model, real_tasks

PHASES = ("rollout", "experience", "train", "sync")
BACKENDS = ("vllm", "megatron")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--append", default=None, help="append the table to this file")
    args = parser.parse_args()
    hf_dir = real_model.smollm2_dir()
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        actor = os.path.join(tmp, "actor")
        hf_to_mcore(hf_dir, actor, parallel=ParallelConfig())
        prompts = real_tasks.write_prompts(os.path.join(tmp, "prompts.jsonl"), real_tasks.TRAIN)
        for backend in BACKENDS:
            config = PPOConfig(actor=actor, prompts=prompts, out_dir=os.path.join(tmp, backend),
                               reward_fn="tests.real_tasks:capital_reward", algorithm="grpo",
                               nproc=2, rollout_backend=backend, vllm_model_dir=hf_dir,
                               prompts_per_step=4, samples_per_prompt=4, max_new_tokens=24,
                               steps=args.steps, actor_lr=1e-6)
            history = run(config)[1:]
            rows[backend] = {key: statistics.median(m[key] for m in history) for key in
                             ["time/wall", *(f"time/{p}" for p in PHASES),
                              "rollout/logprob_gap_max", "rollout/stopped_fraction",
                              "tokens_per_s"]}
    base = rows["vllm"]["time/wall"]
    lines = ["| rollout backend | step (s) | step / vLLM's | " +
             " | ".join(f"{p} (s)" for p in PHASES) +
             " | response tokens/s | gap max | stopped at EOS |",
             "|---" * (6 + len(PHASES)) + "|"]
    for backend, r in rows.items():
        lines.append(f"| {backend} | {r['time/wall']:.1f} | {r['time/wall'] / base:.2f} | " +
                     " | ".join(f"{r[f'time/{p}']:.1f}" for p in PHASES) +
                     f" | {r['tokens_per_s']:.1f} | {r['rollout/logprob_gap_max']:.2g} | "
                     f"{r['rollout/stopped_fraction']:.2f} |")
    body = "\n".join(lines) + (
        f"\n\nMedians of steps 2-{args.steps}. SmolLM2-135M-Instruct (dequantized Q4_1), fp32, "
        "GRPO, 4 prompts x 4 samples x <= 24 new tokens, 2 colocated local ranks (DP2).")
    print(body)
    if args.append:
        append_entry(args.append, "GRPO step on a real model (SmolLM2-135M-Instruct), vLLM vs "
                     "Megatron rollouts", f"python -m bench.bench_real_grpo --steps {args.steps}",
                     body)


if __name__ == "__main__":
    main()
