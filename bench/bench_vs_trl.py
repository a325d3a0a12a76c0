"""GRPO step time of megarlhf against TRL's GRPOTrainer on one workload, in ABBA pairs.
The ratio TRL step / megarlhf step per pair of runs, its median and spread, and accuracy
after the same steps, with both sides' package versions, thread settings and measured prompt
and answer lengths beside every result.

Workloads (`--workload`), every other setting shared:
- `arithmetic` (the default): the arithmetic recipe's rows ("What is 7 times 4? Answer with
  only the number."), at most 12 new tokens.
- `long`: the same rows asked to reason step by step and end with the answer (LONG_ASK), at
  most 256 new tokens, checked by the same `math` reward (its last number or 'the answer is
  N'); each trainer micro-batched for memory: TRL's gradient accumulation over 4 x 8 samples
  (in one micro-batch it was killed for memory at 23 GiB of a 24 GiB machine), megarlhf's
  packed rows of at most 1536 tokens (`pack_sequences`, no padding; 4 padded micro-batches
  per rank spent 1.49 model positions per real token).

The same for both trainers: SmolLM2-135M-Instruct (fp32 weights), the workload's training
rows (chat template), 8 prompts x 4 samples at temperature 1, one update per step (one
mini-batch of 32), lr 1e-5 constant, Adam (0.9, 0.95), gradient clip 1, GRPO's group
advantages divided by the group's std, a k3 KL loss of 0.001 against a frozen reference, the
token-mean loss (TRL's `loss_type="dapo"`, its token mean over the batch), clip 0.2, the
built-in `math` checker, the pair's seed. TRL: one process, HF generate, `use_cpu=True`,
`gradient_checkpointing=False` (TRL 1.16 defaults it on; megarlhf recomputes nothing, and a
run with it on once ended at accuracy 0.0), everything else at TRL's defaults (its documented
accelerations, vLLM, Liger kernels and padding-free batches, are for GPUs), torch's default
thread count (accelerate sets one only for multi-process CPU runs); bf16 is its `bf16=True`,
autocast over fp32 weights. megarlhf: as the recipe says (2 colocated ranks, an equal share
of the cores each, Megatron rollouts); bf16 is `dtype=bf16`, bf16 weights with fp32 master
copies.

Order: pair i (the i-th of `--seeds`) runs megarlhf then TRL when i is even, TRL then
megarlhf when odd (ours, TRL, TRL, ours, ...), so that a host slowing or speeding up over the
bench moves both sides alike over an even number of pairs. Step time: the median of a run's
steps 2-N, each from its start to its end (megarlhf's `time/wall`, TRL's step callbacks), so
that what either trainer does outside its named phases counts. Lengths: mean prompt and
generated answer tokens per sample (stop token included) over a run's steps, as each trainer
had them: megarlhf's from the prompt and response ids its reward function is given, TRL's
from its prompt and completion masks. Accuracy: each trained model's greedy answers to the
64 held-out questions, its weights loaded in fp32, through HF transformers
(bench_rlvr.hf_accuracy, the same function for both), and the source model's; with several
seeds the summary says whether the trainers' mean accuracies differ by more than twice the
standard error of their difference.

The whole bench, both workloads in fp32 and bf16, fits in about two hours on a 2-core CPU
machine with the two commands below. Measured there (2026-12-07): an arithmetic step 12-17 s
per trainer in fp32 and 6-11 s in bf16, ~40 s of start-up per run and seconds of evaluation;
a long-answer step ~140 s for each trainer in fp32 (the first 160-220 s) and ~2 minutes per
accuracy evaluation (64 questions x 256 greedy tokens): 3-4 minutes a pair at 5 arithmetic
steps, ~17 a pair at 2 long-answer steps (whose step time is then the second step's alone).

    python -m bench.bench_vs_trl --workload arithmetic --steps 5 --seeds 0,1,2,3   # ~30 min
    python -m bench.bench_vs_trl --workload long --steps 2 --seeds 0,1             # ~75 min

TRL is not a dependency of megarlhf: the bench installs it once, without dependencies (it
needs nothing the venv lacks), into .venv/trl-<version> and runs it from there.

    python -m bench.bench_vs_trl [--workload arithmetic|long] [--variants fp32,bf16]
        [--seeds 0,1] [--steps 5] [--append BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import NamedTuple

from bench.bench_rlvr import RECIPE, hf_accuracy, recipe_inputs, train_and_export
from bench.report import append_entry
from megarlhf.configio import load_config
from megarlhf.data import synthetic
from megarlhf.engine.optim import OptimConfig
from megarlhf.ppo.config import PPOConfig
from megarlhf.rewards import math_reward

TRL_VERSION = "1.16.0"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRL_DIR = os.path.join(REPO, ".venv", f"trl-{TRL_VERSION}")
OPTIM = OptimConfig(clip_grad=1.0)
"""The actor's Adam and clipping in a megarlhf PPO run (ppo/worker.py), given to TRL too."""
PACKAGES = ("torch", "transformers", "trl", "accelerate", "datasets", "megatron-core")
THREAD_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
TRAINERS = ("megarlhf", "TRL")
"""The two sides, in the order every table gives them."""


class Workload(NamedTuple):
    ask: str
    """What each question asks of the answer (replacing the recipe's)."""
    max_new_tokens: int
    trl_micro_batches: int = 1
    """TRL's micro-batches per update (gradient accumulation): what fits the workload into
    this machine's memory."""
    megarlhf: tuple[str, ...] = ()
    """megarlhf's overrides for the same (its micro-batching)."""


LONG_ASK = (" Think step by step and explain each step, then give the final answer at the end "
            "as 'The answer is N'.")
WORKLOADS = {"arithmetic": Workload(synthetic.ANSWER_FORMAT, 12),
             # In one micro-batch TRL reached 23 GiB (of 24), a megarlhf rank 11. megarlhf
             # packs each rank's samples into rows of <= 1536 tokens (no padding: 1.0 model
             # positions per token where 4 padded micro-batches had 1.49); TRL pads (its
             # padding-free batches are for GPU flash attention).
             "long": Workload(LONG_ASK, 256, trl_micro_batches=4,
                              megarlhf=("pack_sequences=true",
                                        "max_tokens_per_micro_batch=1536"))}


def ensure_trl() -> str:
    """The directory TRL is installed in (installed there first when missing)."""
    if not os.path.isdir(os.path.join(TRL_DIR, "trl")):
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps",
                        "--target", TRL_DIR, f"trl=={TRL_VERSION}"], check=True)
    return TRL_DIR


def environment() -> dict:
    """This process's package versions (None: not importable here), thread settings and the
    CPU kernels torch dispatches to (AVX512, AVX2, ...)."""
    import torch

    def version(package):
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    return {"versions": {p: version(p) for p in PACKAGES},
            "threads": {"torch": torch.get_num_threads(),
                        **{v: os.environ.get(v) for v in THREAD_VARIABLES}},
            "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def cpu() -> str:
    """This machine's CPU model and the bf16 matrix instructions it offers (torch's bf16
    matmuls use them where present): what may differ between machine images."""
    with open("/proc/cpuinfo") as f:
        info = f.read()
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                  if line.startswith("model name")), "unknown")
    flags = [flag for flag in ("avx512_bf16", "amx_bf16") if f" {flag}" in info]
    return f"{model}, {', '.join(flags) or 'no bf16 matrix instructions'}"


def math_with_lengths(responses, ground_truths, prompt_ids, response_ids, **_) -> dict:
    """megarlhf's reward here: the built-in `math` reward, also reporting each sample's prompt
    and answer tokens (the step metrics reward/prompt_tokens, reward/answer_tokens)."""
    return {**math_reward(responses, ground_truths),
            "prompt_tokens": [float(len(p)) for p in prompt_ids],
            "answer_tokens": [float(len(r)) for r in response_ids]}


def trl_worker(spec_path: str) -> None:
    """Runs in TRL's environment: trains as the spec says, writes step times, lengths, the
    environment and the model."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

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
    lengths: dict[str, list[int]] = {"prompt": [], "answer": []}

    class StepTimes(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            times.append(time.perf_counter() - self.start)

    class Measured(GRPOTrainer):
        """Records each sample's prompt and answer tokens, as its masks give them."""

        def _generate_and_score_completions(self, inputs):
            out = super()._generate_and_score_completions(inputs)
            lengths["prompt"] += out["prompt_mask"].sum(1).tolist()
            lengths["answer"] += out["completion_mask"].sum(1).tolist()
            return out

    per_step = config["prompts_per_step"] * config["samples_per_prompt"]
    micro_batches = spec["micro_batches"]  # one generation of per_step samples per update
    args = GRPOConfig(
        output_dir=spec["out_dir"], use_cpu=True, bf16=spec["dtype"] == "bf16",
        gradient_checkpointing=False, per_device_train_batch_size=per_step // micro_batches,
        gradient_accumulation_steps=micro_batches,
        num_generations=config["samples_per_prompt"],
        max_completion_length=config["max_new_tokens"], temperature=config["temperature"],
        learning_rate=config["actor_lr"], lr_scheduler_type="constant", warmup_steps=0,
        weight_decay=0.0, adam_beta1=OPTIM.adam_beta1, adam_beta2=OPTIM.adam_beta2,
        adam_epsilon=OPTIM.adam_eps, max_grad_norm=OPTIM.clip_grad, max_steps=config["steps"],
        beta=config["kl_coef"], epsilon=config["clip_eps"], loss_type="dapo",
        scale_rewards="group", num_iterations=1, shuffle_dataset=False, seed=config["seed"],
        logging_steps=1, save_strategy="no", report_to=[], disable_tqdm=True,
        model_init_kwargs={"dtype": "float32"})
    trainer = Measured(model=spec["model"], reward_funcs=reward, args=args,
                       train_dataset=dataset, callbacks=[StepTimes()])
    trainer.train()
    trainer.save_model(spec["export"])
    with open(spec["result"], "w") as f:
        json.dump({"step_times": times, "lengths": lengths, "environment": environment()}, f)


def median_step(times: list[float]) -> float:
    """The median of steps 2-N (the first warms up), of the one step if there is one."""
    return statistics.median(times[1:] or times)


def run_trl(root: str, hf_dir: str, config: PPOConfig, dtype: str, micro_batches: int
            ) -> dict:
    os.makedirs(root)
    spec = {"model": hf_dir, "prompts": config.prompts, "dtype": dtype,
            "micro_batches": micro_batches,
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
    return {"step": median_step(result["step_times"]), "model": spec["export"],
            "prompt_tokens": statistics.mean(result["lengths"]["prompt"]),
            "answer_tokens": statistics.mean(result["lengths"]["answer"]),
            "environment": result["environment"]}


def run_megarlhf(root: str, overrides: list[str], config: PPOConfig) -> dict:
    from megarlhf.ppo.layout import group_specs
    from megarlhf.ppo.placement import backend

    os.makedirs(root)
    _, history, exported = train_and_export(root, RECIPE, overrides, None)
    env = environment()
    # The ranks' threads, not this process's: the run's backend gives each rank its share
    # as OMP_NUM_THREADS and torch's thread count (parallel/launcher.py).
    per_rank = backend(config).threads
    env["threads"].update(torch=f"{sum(s.nproc for s in group_specs(config))} ranks x "
                                f"{per_rank}", OMP_NUM_THREADS=str(per_rank))
    return {"step": median_step([m["time/wall"] for m in history]), "model": exported,
            "prompt_tokens": statistics.mean(m["reward/prompt_tokens"] for m in history),
            "answer_tokens": statistics.mean(m["reward/answer_tokens"] for m in history),
            "environment": env}


def run_pair(root: str, hf_dir: str, inputs: list[str], workload: Workload, dtype: str,
             seed: int, steps: int, order: tuple[str, str]) -> dict[str, dict]:
    """Both trainers on the same settings, one after the other in `order`."""
    overrides = [*inputs, f"dtype={dtype}", f"seed={seed}", f"steps={steps}",
                 f"max_new_tokens={workload.max_new_tokens}", "val_every=0", "val_prompts=null",
                 "reward_fn=bench.bench_vs_trl:math_with_lengths", *workload.megarlhf]
    config = load_config(PPOConfig, RECIPE, overrides)
    run = {"megarlhf": lambda: run_megarlhf(f"{root}-megarlhf", overrides, config),
           "TRL": lambda: run_trl(f"{root}-trl", hf_dir, config, dtype,
                                  workload.trl_micro_batches)}
    return {name: run[name]() for name in order}


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


def threads(env: dict) -> str:
    t = env["threads"]
    return f"torch {t['torch']}, " + ", ".join(f"{v}={t[v] or 'unset'}"
                                               for v in THREAD_VARIABLES)


def versions(env: dict) -> str:
    return ", ".join(f"{p} {v}" for p, v in env["versions"].items() if v) + \
        f", torch's CPU kernels {env['cpu_capability']}"


def side_by_side(cell) -> str:
    """'megarlhf's / TRL's': `cell(trainer)` for each."""
    return " / ".join(cell(name) for name in TRAINERS)


def pair_row(dtype: str, pair: str, order: tuple[str, str], runs: dict[str, dict]) -> str:
    ratio = runs["TRL"]["step"] / runs["megarlhf"]["step"]
    cells = [dtype, pair, ", ".join(order), side_by_side(lambda n: f"{runs[n]['step']:.2f}"),
             f"{ratio:.2f}x", side_by_side(lambda n: f"{runs[n]['prompt_tokens']:.1f}"),
             side_by_side(lambda n: f"{runs[n]['answer_tokens']:.1f}"),
             side_by_side(lambda n: f"{runs[n]['accuracy']:.3f}"),
             side_by_side(lambda n: threads(runs[n]["environment"]))]
    return "| " + " | ".join(cells) + " |"


def summary_row(dtype: str, pairs: list[dict[str, dict]]) -> str:
    ratios = [p["TRL"]["step"] / p["megarlhf"]["step"] for p in pairs]

    def mean(key):
        return lambda n: f"{statistics.mean(p[n][key] for p in pairs):.1f}"

    cells = [dtype, f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})",
             side_by_side(mean("prompt_tokens")), side_by_side(mean("answer_tokens")),
             side_by_side(lambda n: spread([p[n]["accuracy"] for p in pairs]))]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="arithmetic")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--variants", default="fp32,bf16")
    parser.add_argument("--seeds", default="0,1", help="one pair of runs per seed, in ABBA "
                        "order, for each dtype, comma-separated")
    parser.add_argument("--append", default=None, help="append the result to this file")
    parser.add_argument("--trl-worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        trl_worker(args.trl_worker)
        return
    workload = WORKLOADS[args.workload]
    seeds = [int(s) for s in args.seeds.split(",")]
    lines = ["| dtype | pair (seed) | order | step (s), ours / TRL | TRL step / ours | "
             "prompt tokens, ours / TRL | answer tokens, ours / TRL | accuracy, ours / TRL | "
             "threads, ours / TRL |", "|---" * 9 + "|"]
    summary = ["| dtype | TRL step / ours, median (min-max) over pairs | prompt tokens, ours / "
               "TRL | answer tokens, ours / TRL | accuracy, ours / TRL |", "|---" * 5 + "|"]
    verdicts, environments = [], {name: set() for name in TRAINERS}
    with tempfile.TemporaryDirectory() as tmp:
        hf_dir, val, inputs = recipe_inputs(tmp, workload.ask)
        source = hf_accuracy(hf_dir, val, workload.max_new_tokens)
        for dtype in args.variants.split(","):
            pairs = []
            for i, seed in enumerate(seeds):
                # ABBA: ours, TRL, TRL, ours, ...
                order = ("megarlhf", "TRL") if i % 2 == 0 else ("TRL", "megarlhf")
                runs = run_pair(os.path.join(tmp, f"{dtype}-seed{seed}"), hf_dir, inputs,
                                workload, dtype, seed, args.steps, order)
                for name, r in runs.items():
                    r["accuracy"] = hf_accuracy(r["model"], val, workload.max_new_tokens)
                    environments[name].add(versions(r["environment"]))
                pairs.append(runs)
                lines.append(pair_row(dtype, f"{i} ({seed})", order, runs))
                print(lines[-1], flush=True)
            summary.append(summary_row(dtype, pairs))
            verdicts.append(f"{dtype}, accuracy against TRL's: " + noise_verdict(
                *([p[n]["accuracy"] for p in pairs] for n in TRAINERS)))
    body = "\n".join(lines + [""] + summary) + "\n\n" + "\n".join(
        f"- {v}" for v in verdicts) + (
        f"\n\nWorkload `{args.workload}`: at most {workload.max_new_tokens} new tokens, the "
        f"question asks {workload.ask.strip()!r}. Pairs in ABBA order (even pairs megarlhf "
        f"first), seeds {args.seeds}. Steps: medians of steps 2-{args.steps} of each run. Lengths: "
        f"mean tokens per sample over each run's steps, as each trainer had them. Accuracy: "
        f"greedy answers to the 64 held-out questions after {args.steps} steps (HF "
        f"transformers, the same function for both), the trained weights loaded in fp32; the "
        f"source model: {source:.3f}. Summary: ratios' median (min-max) over the pairs, "
        f"lengths' means, accuracies' mean +- standard deviation over the seeds. "
        + "; ".join(f"{name}'s process: {'; '.join(sorted(found))}"
                    for name, found in environments.items()) +
        f". CPU: {cpu()}. megarlhf at {os.path.relpath(RECIPE, REPO)}"
        f"{''.join(' ' + o for o in workload.megarlhf)}; TRL {TRL_VERSION} in one process, "
        f"{workload.trl_micro_batches} micro-batch(es) per update. Settings in "
        f"bench/bench_vs_trl.py's docstring.")
    print(body)
    if args.append:
        append_entry(args.append, f"GRPO step: megarlhf vs TRL's GRPOTrainer, ABBA pairs "
                     f"({args.workload} workload)", f"python -m bench.bench_vs_trl --workload "
                     f"{args.workload} --steps {args.steps} --variants {args.variants} --seeds "
                     f"{args.seeds}", body)


if __name__ == "__main__":
    main()
