"""The arithmetic GRPO recipe through TRL's GRPOTrainer and through megarlhf, side by side in
one run: step time (median of steps 2-N) and held-out accuracy after the same steps, fp32 and
bf16.

The same for both: SmolLM2-135M-Instruct (fp32 weights), the recipe's training rows (chat
template), 8 prompts x 4 samples x <= 12 new tokens at temperature 1, one update per step
(one mini-batch of 32), lr 1e-5 constant, Adam (0.9, 0.95), gradient clip 1, GRPO's group
advantages divided by the group's std, a k3 KL loss of 0.001 against a frozen reference, the
token-mean loss (TRL's `loss_type="dapo"`, its token mean over the batch), clip 0.2, the
built-in `math` checker, seed 0 (`--seeds`: several, each run by both). TRL runs in one
process with this machine's threads (HF generate, `use_cpu=True`; bf16 is its `bf16=True`,
autocast over fp32 weights); megarlhf as the recipe says (2 colocated ranks, Megatron
rollouts; bf16 is `dtype=bf16`, bf16 weights with fp32 master copies). Accuracy: each
trained model's greedy answers to the recipe's 64 held-out questions through HF transformers
(bench_rlvr.hf_accuracy, the same function for both), and the source model's. One 5-step run
on 64 questions is a noisy measure (seeds of one trainer spread by 0.2 and more): with several
seeds the summary says whether the trainers' mean accuracies differ by more than twice the
standard error of their difference.

TRL is not a dependency of megarlhf: the bench installs it once, without dependencies (it
needs nothing the venv lacks), into .venv/trl-<version> and runs it from there.

    python -m bench.bench_vs_trl [--steps 8] [--variants fp32,bf16] [--seeds 0,1,2]
        [--append BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from bench.bench_rlvr import RECIPE, hf_accuracy, recipe_inputs, train_and_export
from bench.report import append_entry
from megarlhf.engine.optim import OptimConfig
from megarlhf.ppo.config import PPOConfig

TRL_VERSION = "1.16.0"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRL_DIR = os.path.join(REPO, ".venv", f"trl-{TRL_VERSION}")
OPTIM = OptimConfig(clip_grad=1.0)
"""The actor's Adam and clipping in a megarlhf PPO run (ppo/worker.py), given to TRL too."""


def ensure_trl() -> str:
    """The directory TRL is installed in (installed there first when missing)."""
    if not os.path.isdir(os.path.join(TRL_DIR, "trl")):
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                        "--target", TRL_DIR, f"trl=={TRL_VERSION}"], check=True)
    return TRL_DIR


def trl_worker(spec_path: str) -> None:
    """Runs in TRL's environment: trains as the spec says, writes step times and the model."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megarlhf.rewards import math_reward

    with open(spec_path) as f:
        spec = json.load(f)
    config = spec["config"]
    rows = [json.loads(line) for line in open(spec["prompts"])]
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r["prompt"]}],
          "ground_truth": r["ground_truth"]} for r in rows])

    def reward(completions, ground_truth, **_):
        texts = [c[-1]["content"] for c in completions]
        return [float(s) for s in math_reward(texts, ground_truth)["scores"]]

    times: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            times.append(time.perf_counter() - self.start)

    per_step = config["prompts_per_step"] * config["samples_per_prompt"]
    args = GRPOConfig(
        output_dir=spec["out_dir"], use_cpu=True, bf16=spec["dtype"] == "bf16",
        per_device_train_batch_size=per_step, gradient_accumulation_steps=1,
        num_generations=config["samples_per_prompt"],
        max_completion_length=config["max_new_tokens"], temperature=config["temperature"],
        learning_rate=config["actor_lr"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, adam_beta1=OPTIM.adam_beta1, adam_beta2=OPTIM.adam_beta2,
        adam_epsilon=OPTIM.adam_eps, max_grad_norm=OPTIM.clip_grad, max_steps=config["steps"],
        beta=config["kl_coef"], epsilon=config["clip_eps"], loss_type="dapo",
        scale_rewards="group", num_iterations=1, shuffle_dataset=False, seed=config["seed"],
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
        model_init_kwargs={"dtype": "float32"})
    trainer = GRPOTrainer(model=spec["model"], reward_funcs=reward, args=args,
                          train_dataset=dataset, callbacks=[StepTimes()])
    trainer.train()
    trainer.save_model(spec["export"])
    with open(spec["result"], "w") as f:
        json.dump({"step_times": times, "threads": torch.get_num_threads()}, f)


def run_trl(tmp: str, hf_dir: str, config: PPOConfig, dtype: str) -> dict:
    root = os.path.join(tmp, f"trl-{dtype}")
    os.makedirs(root)
    spec = {"model": hf_dir, "prompts": config.prompts, "dtype": dtype,
            "out_dir": os.path.join(root, "out"), "export": os.path.join(root, "model"),
            "result": os.path.join(root, "result.json"),
            "config": {"prompts_per_step": config.prompts_per_step,
                       "samples_per_prompt": config.samples_per_prompt,
                       "max_new_tokens": config.max_new_tokens,
                       "temperature": config.temperature, "actor_lr": config.actor_lr,
                       "steps": config.steps, "seed": config.seed,
                       "kl_coef": config.options.kl_coef, "clip_eps": config.options.clip_eps}}
    with open(os.path.join(root, "spec.json"), "w") as f:
        json.dump(spec, f)
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([ensure_trl(), REPO, os.environ.get("PYTHONPATH", "")])}
    subprocess.run([sys.executable, "-m", "bench.bench_vs_trl", "--trl-worker",
                    os.path.join(root, "spec.json")], env=env, check=True)
    with open(spec["result"]) as f:
        result = json.load(f)
    return {"step": statistics.median(result["step_times"][1:] or result["step_times"]),
            "model": spec["export"], "threads": result["threads"]}


def run_megarlhf(tmp: str, inputs: list[str], dtype: str, steps: int,
                 old_logprobs: str, seed: int) -> tuple[PPOConfig, dict]:
    root = os.path.join(tmp, f"megarlhf-{dtype}-{old_logprobs}")
    os.makedirs(root)
    config, history, exported = train_and_export(
        root, RECIPE, [*inputs, f"dtype={dtype}", "val_every=0", "val_prompts=null",
                       f"seed={seed}", f"old_logprobs={old_logprobs}"], steps)
    return config, {"step": statistics.median(m["time/step"] for m in history[1:] or history),
                    "model": exported}


def bf16_changed_share(source_dir: str, trained_dir: str) -> float:
    """The share of the weights' elements whose bf16 value differs from the source's: what a
    bf16 model can hold of the training (tensors both directories have)."""
    import glob

    import torch
    from safetensors.torch import load_file

    def tensors(directory):
        out = {}
        for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
            out.update(load_file(path))
        return out

    source, trained = tensors(source_dir), tensors(trained_dir)
    changed = total = 0
    for name in source.keys() & trained.keys():
        a, b = source[name].to(torch.bfloat16), trained[name].to(torch.bfloat16)
        changed += int((a != b).sum())
        total += a.numel()
    return changed / total


def spread(values: list[float]) -> str:
    """mean +- sample standard deviation (the mean alone for one value)."""
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} +- {statistics.stdev(values):.3f}"


def noise_verdict(ours: list[float], theirs: list[float]) -> str:
    """Whether two trainers' mean accuracies over seeds differ by more than twice the
    standard error of their difference (each run's own spread over the seeds)."""
    if len(ours) < 2:
        return "one seed each: no spread to compare against"
    diff = statistics.mean(ours) - statistics.mean(theirs)
    se = (statistics.variance(ours) / len(ours) + statistics.variance(theirs) / len(theirs)) ** .5
    inside = abs(diff) <= 2 * se
    return (f"difference {diff:+.3f}, 2 x its standard error {2 * se:.3f}: "
            f"{'within' if inside else 'outside'} seed noise")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--variants", default="fp32,bf16")
    parser.add_argument("--experience-pass", action="store_true",
                        help="also run megarlhf with old_logprobs=experience_pass (the actor's "
                             "separate old-logprob forward: the step before it was cut)")
    parser.add_argument("--seeds", default="0", help="both trainers' seeds, comma-separated: "
                        "each dtype runs every seed; the summary compares the accuracies' "
                        "means against their spread")
    parser.add_argument("--append", default=None, help="append the result to this file")
    parser.add_argument("--trl-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        trl_worker(args.trl_worker)
        return
    seeds = [int(s) for s in args.seeds.split(",")]
    ours = ["auto"] + (["experience_pass"] if args.experience_pass else [])
    lines = ["| dtype | seed | trainer | step (s) | TRL step / this | accuracy (fp32 weights) | "
             "accuracy (bf16 weights) | bf16 elements changed |", "|---" * 8 + "|"]
    summary = ["| dtype | trainer | step (s), median over seeds | TRL step / this | "
               "accuracy (fp32 weights) | accuracy (bf16 weights) |", "|---" * 6 + "|"]
    verdicts = []
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir, val, inputs = recipe_inputs(tmp)
        source = None
        for dtype in args.variants.split(","):
            by_trainer: dict[str, list[dict]] = {}
            for seed in seeds:
                runs = {}
                for mode in ours:
                    config, runs[f"megarlhf, old_logprobs={mode}"] = run_megarlhf(
                        os.path.join(tmp, f"seed{seed}"), inputs, dtype, args.steps, mode,
                        seed)
                theirs = runs["TRL"] = run_trl(os.path.join(tmp, f"seed{seed}"), hf_dir,
                                               config, dtype)
                if source is None:
                    source = {d: hf_accuracy(hf_dir, val, config.max_new_tokens, d)
                              for d in ("float32", "bfloat16")}
                for name in ["TRL"] + [n for n in runs if n != "TRL"]:
                    r = runs[name]
                    r["accuracy"] = [hf_accuracy(r["model"], val, config.max_new_tokens, d)
                                     for d in ("float32", "bfloat16")]
                    by_trainer.setdefault(name, []).append(r)
                    lines.append(f"| {dtype} | {seed} | {name} | {r['step']:.2f} | "
                                 f"{theirs['step'] / r['step']:.2f}x | {r['accuracy'][0]:.3f} | "
                                 f"{r['accuracy'][1]:.3f} | "
                                 f"{bf16_changed_share(hf_dir, r['model']):.3f} |")
                    print(lines[-1], flush=True)
            trl_step = statistics.median(r["step"] for r in by_trainer["TRL"])
            for name, rs in by_trainer.items():
                step = statistics.median(r["step"] for r in rs)
                summary.append(f"| {dtype} | {name} | {step:.2f} | {trl_step / step:.2f}x | "
                               f"{spread([r['accuracy'][0] for r in rs])} | "
                               f"{spread([r['accuracy'][1] for r in rs])} |")
                if name != "TRL":
                    verdicts.append(f"{dtype}, {name} against TRL (fp32 weights): " + noise_verdict(
                        [r["accuracy"][0] for r in rs],
                        [r["accuracy"][0] for r in by_trainer["TRL"]]))
    body = "\n".join(lines + [""] + summary) + "\n\n" + "\n".join(
        f"- {v}" for v in verdicts) + (
        f"\n\nSteps: medians of steps 2-{args.steps} of each run. Accuracy: greedy answers to "
        f"the recipe's 64 held-out questions after {args.steps} steps (HF transformers, the "
        f"same function for all), the trained weights loaded in fp32 and cast to bf16; the "
        f"source model: {source['float32']:.3f} (fp32), {source['bfloat16']:.3f} (bf16). "
        f"Summary: mean +- standard deviation over seeds {args.seeds}. "
        f"bf16 elements changed: the share of weight elements whose bf16 value differs from "
        f"the source's. TRL {TRL_VERSION} in one process ({theirs['threads']} threads); "
        f"megarlhf at {os.path.relpath(RECIPE, REPO)} (2 colocated ranks). Settings in "
        f"bench/bench_vs_trl.py's docstring.")
    print(body)
    if args.append:
        append_entry(args.append, "GRPO step: megarlhf vs TRL's GRPOTrainer (arithmetic "
                     "recipe)", f"python -m bench.bench_vs_trl --steps {args.steps} "
                     f"--variants {args.variants} --seeds {args.seeds}"
                     + (" --experience-pass" if args.experience_pass else ""), body)


if __name__ == "__main__":
    main()
