"""DPO on a real model: recipes/smollm2-135m-dpo-arithmetic.yaml (SmolLM2-135M-Instruct, the
real-model tier's, on preference pairs made from the arithmetic task: the right answer
chosen, a wrong one rejected; an SFT term on the chosen answer; the reference cached), with
the same recipe's live reference and the SFT stage's step time on the same rows beside it.

Measured: greedy accuracy on the 64 held-out questions before and after (HF transformers'
generate on the starting model and on the run's HF export, answers checked by the built-in
`math` reward), the implicit-reward accuracy and margin on held-out pairs every 5 steps (the
curve), and the median step time of the recipe (cached reference), of the recipe with
`dpo.reference=live` (a reference forward each step), of the recipe with token-budget
micro-batches (`train.max_tokens_per_micro_batch` of BUDGET_PAIRS pairs of
`data.max_length` rows, each micro-batch cut to its rows' widths, instead of one pair per
micro-batch at the step's width) and of SFT over the same pairs' rows (both responses of
each pair as SFT rows, unpacked: the same tokens through the policy). fp32, 2 local ranks
(DP2), as the recipe says.

    python -m bench.bench_dpo [--steps 30] [--compare-steps 8] [--append BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile

import torch

from bench.report import append_entry
from megarlhf.configio import load_config
from megarlhf.convert.hf_to_mcore import hf_to_mcore
from megarlhf.data import synthetic
from megarlhf.data.config import DataConfig, DatasetSource
from megarlhf.parallel import launch_local
from megarlhf.parallel.mesh import ParallelConfig
from megarlhf.rewards.builtin import math_reward
from megarlhf.sft.config import DPOConfig, LoopConfig, ModelSource, SFTConfig
from megarlhf.sft.dpo import run_dpo
from megarlhf.sft.sft import run_sft
from tests import real_model

RECIPE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "recipes",
                      "smollm2-135m-dpo-arithmetic.yaml")
NPROC = 2  # the recipe's run command's --nproc
BUDGET_PAIRS = 4


def greedy_accuracy(hf_dir: str, rows: list[dict]) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": r["prompt"]}],
                                           tokenize=False, add_generation_prompt=True)
             for r in rows]
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=12, do_sample=False,
                             pad_token_id=tokenizer.pad_token_id)
    answers = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:],
                                     skip_special_tokens=True)
    scores = math_reward(answers, [r["ground_truth"] for r in rows])["scores"]
    return sum(scores) / len(scores)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="default: the recipe's")
    parser.add_argument("--compare-steps", type=int, default=8,
                        help="steps of the live-reference and SFT runs (step time only)")
    parser.add_argument("--append", default=None, help="append the results to this file")
    args = parser.parse_args()
    hf_dir = real_model.smollm2_dir()
    train_rows, val_rows = synthetic.arithmetic_records(held_out=64)
    train_pairs, val_pairs = (synthetic.arithmetic_pairs(train_rows, seed=0),
                              synthetic.arithmetic_pairs(val_rows, seed=1))
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        hf_to_mcore(hf_dir, ckpt, parallel=ParallelConfig())
        paths = [f"model.checkpoint={ckpt}",
                 f"data.train.path={synthetic.write_jsonl(train_pairs, tmp + '/t.jsonl')}",
                 f"data.eval.path={synthetic.write_jsonl(val_pairs, tmp + '/v.jsonl')}"]
        recipe = load_config(DPOConfig, RECIPE, paths + [
            f"train.output_dir={tmp}/cached", f"train.export_hf={tmp}/cached-hf",
            *([f"train.steps={args.steps}"] if args.steps else [])])
        compare = ["train.export_hf=null", "train.eval_interval=0",
                   f"train.steps={args.compare_steps}"]
        live = load_config(DPOConfig, RECIPE, paths + compare + [
            f"train.output_dir={tmp}/live", "dpo.reference=live"])
        budget = 2 * BUDGET_PAIRS * recipe.data.max_length
        budgeted = load_config(DPOConfig, RECIPE, paths + compare + [
            f"train.output_dir={tmp}/budget", f"train.max_tokens_per_micro_batch={budget}"])
        before = greedy_accuracy(hf_dir, val_rows)
        run = launch_local(run_dpo, NPROC, recipe)[0]
        after = greedy_accuracy(run["export"], val_rows)
        live_out = launch_local(run_dpo, NPROC, live)[0]
        budget_out = launch_local(run_dpo, NPROC, budgeted)[0]
        sft = SFTConfig(
            model=ModelSource(checkpoint=ckpt),
            data=DataConfig(train=DatasetSource(path=synthetic.write_jsonl(
                [{"prompt": p["prompt"], "response": p[k]} for p in train_pairs
                 for k in ("chosen", "rejected")], tmp + "/sft.jsonl")),
                max_length=recipe.data.max_length),
            # The same rows per micro-batch as DPO's (a pair's two sequences), so the same
            # number of micro-batches.
            train=LoopConfig(output_dir=os.path.join(tmp, "sft"), steps=args.compare_steps,
                             global_batch_size=2 * recipe.train.global_batch_size,
                             micro_batch_size=2 * recipe.train.micro_batch_size),
            optim=recipe.optim, pack=False)
        sft_out = launch_local(run_sft, NPROC, sft)[0]
    lines = ["| step | held-out loss | reward accuracy | reward margin | chosen logp | "
             "rejected logp |", "|---|---|---|---|---|---|"]
    for r in run["history"]:
        if r["split"] == "eval":
            lines.append(f"| {r['step']} | {r['loss']:.4f} | {r['reward_accuracy']:.3f} | "
                         f"{r['reward_margin']:.4f} | {r['chosen_logp']:.3f} | "
                         f"{r['rejected_logp']:.3f} |")

    def step_s(out: dict) -> float:
        return statistics.median(r["step_s"] for r in out["history"][1:]
                                 if r["split"] == "train")

    cached_s, live_s, sft_s = step_s(run), step_s(live_out), step_s(sft_out)
    budget_s = step_s(budget_out)
    micro = statistics.median(r["microbatches"] for r in budget_out["history"]
                              if r["split"] == "train")
    first = [out["history"][0]["loss"] for out in (run, live_out)]
    settings = recipe.dpo
    body = "\n".join(lines) + (
        f"\n\nGreedy accuracy on the 64 held-out questions: {before:.3f} before, "
        f"{after:.3f} after {recipe.train.steps} steps. Step time (median of steps 2-N): "
        f"cached reference {cached_s:.2f} s, live reference {live_s:.2f} s (ratio "
        f"{live_s / cached_s:.2f}), cached with micro-batches of up to {budget} tokens "
        f"{budget_s:.2f} s (cached / budget {cached_s / budget_s:.2f}; {micro:g} micro-batches "
        f"per rank and step, against {recipe.train.num_microbatches(NPROC)} of one pair), "
        f"SFT on the same pairs' rows (both responses, unpacked) "
        f"{sft_s:.2f} s (DPO cached / SFT {cached_s / sft_s:.2f}); step 1's loss cached "
        f"{first[0]:.6f}, live {first[1]:.6f}. The recipe: {recipe.train.global_batch_size} "
        f"pairs per step, lr {recipe.optim.lr:g}, beta {settings.temperature:g}, sft_weight "
        f"{settings.sft_weight:g}, fp32, {NPROC} local ranks (DP{NPROC}); the live, budget and "
        f"SFT runs {args.compare_steps} steps each. Held-out pairs: the 64 questions, each with "
        f"its answer chosen and a number 1-3 away rejected.")
    print(body)
    if args.append:
        append_entry(args.append, "DPO recipe on a real model (SmolLM2-135M-Instruct, "
                     "arithmetic pairs, cached reference)",
                     "python -m bench.bench_dpo" + (f" --steps {args.steps}" if args.steps
                                                    else ""), body)


if __name__ == "__main__":
    main()
