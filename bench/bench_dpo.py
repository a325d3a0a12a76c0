"""DPO on a real model: SmolLM2-135M-Instruct (the real-model tier's) on preference pairs made
from the arithmetic task (the GRPO recipe's questions; the right answer chosen, a wrong one
rejected), with the SFT stage's step time on the same rows beside it.

Two DPO runs, plain and with an SFT term on the chosen answer (dpo.sft_weight). Measured:
greedy accuracy on the 64 held-out questions before and after (HF transformers' generate on
the starting model and on each run's HF export, answers checked by the built-in `math`
reward), the implicit-reward accuracy and margin on held-out pairs every few steps (the
curve), and the median step time of DPO vs SFT over the same pairs' rows (both responses
of each pair as SFT rows, unpacked: the same tokens through the policy; DPO adds the
reference's forward). fp32, 2 local ranks (DP2).

    python -m bench.bench_dpo [--steps 30] [--sft-weight 1.0] [--append BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile

import torch

from bench.report import append_entry
from megarlhf.convert.hf_to_mcore import hf_to_mcore
from megarlhf.data import synthetic
from megarlhf.data.config import DataConfig, DatasetSource
from megarlhf.engine.optim import OptimConfig
from megarlhf.parallel import launch_local
from megarlhf.parallel.mesh import ParallelConfig
from megarlhf.rewards.builtin import math_reward
from megarlhf.sft.config import DPOConfig, DPOSettings, LoopConfig, ModelSource, SFTConfig
from megarlhf.sft.dpo import run_dpo
from megarlhf.sft.sft import run_sft
from tests import real_model

PAIRS_PER_STEP = 8


def pairs(rows: list[dict], seed: int) -> list[dict]:
    """Each question with its answer chosen and a nearby wrong number rejected."""
    rng = random.Random(seed)
    out = []
    for row in rows:
        right = int(row["ground_truth"])
        wrong = right + rng.choice([d for d in (-3, -2, -1, 1, 2, 3) if right + d >= 0])
        out.append({"prompt": row["prompt"], "chosen": str(right), "rejected": str(wrong)})
    return out


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
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=2e-6)
    parser.add_argument("--sft-weight", type=float, default=1.0,
                        help="the second run's dpo.sft_weight (the first run's is 0)")
    parser.add_argument("--append", default=None, help="append the results to this file")
    args = parser.parse_args()
    hf_dir = real_model.smollm2_dir()
    train_rows, val_rows = synthetic.arithmetic_records(held_out=64)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = os.path.join(tmp, "ckpt")
        hf_to_mcore(hf_dir, ckpt, parallel=ParallelConfig())
        train_pairs = synthetic.write_jsonl(pairs(train_rows, 0), os.path.join(tmp, "t.jsonl"))
        val_pairs = synthetic.write_jsonl(pairs(val_rows, 1), os.path.join(tmp, "v.jsonl"))
        sft_rows = synthetic.write_jsonl(
            [{"prompt": p["prompt"], "response": p[k]}
             for p in pairs(train_rows, 0) for k in ("chosen", "rejected")],
            os.path.join(tmp, "sft.jsonl"))
        optim = OptimConfig(lr=args.lr, weight_decay=0.0, clip_grad=1.0)
        every = max(args.steps // 6, 1)
        runs, after = {}, {}
        before = greedy_accuracy(hf_dir, val_rows)
        for sft_weight in (0.0, args.sft_weight):
            name, tag = f"sft_weight {sft_weight:g}", f"dpo-sft{sft_weight:g}"
            dpo = DPOConfig(
                model=ModelSource(checkpoint=ckpt),
                data=DataConfig(train=DatasetSource(path=train_pairs),
                                eval=DatasetSource(path=val_pairs), max_length=96),
                train=LoopConfig(output_dir=os.path.join(tmp, tag), steps=args.steps,
                                 global_batch_size=PAIRS_PER_STEP, eval_interval=every,
                                 export_hf=os.path.join(tmp, tag + "-hf")),
                optim=optim, dpo=DPOSettings(loss="dpo", beta=0.1, sft_weight=sft_weight))
            runs[name] = launch_local(run_dpo, 2, dpo)[0]
            after[name] = greedy_accuracy(runs[name]["export"], val_rows)
        sft = SFTConfig(
            model=ModelSource(checkpoint=ckpt),
            data=DataConfig(train=DatasetSource(path=sft_rows), max_length=96),
            train=LoopConfig(output_dir=os.path.join(tmp, "sft"), steps=min(args.steps, 10),
                             global_batch_size=2 * PAIRS_PER_STEP),
            optim=optim, pack=False)
        sft_out = launch_local(run_sft, 2, sft)[0]
    lines = ["| run | step | held-out loss | reward accuracy | reward margin | chosen logp | "
             "rejected logp |", "|---|---|---|---|---|---|---|"]
    for name, out in runs.items():
        for r in out["history"]:
            if r["split"] == "eval":
                lines.append(f"| {name} | {r['step']} | {r['loss']:.4f} | "
                             f"{r['reward_accuracy']:.3f} | {r['reward_margin']:.4f} | "
                             f"{r['chosen_logp']:.3f} | {r['rejected_logp']:.3f} |")
    plain = runs["sft_weight 0"]
    dpo_s = statistics.median(r["step_s"] for r in plain["history"][1:] if r["split"] == "train")
    sft_s = statistics.median(r["step_s"] for r in sft_out["history"][1:]
                              if r["split"] == "train")
    body = "\n".join(lines) + (
        f"\n\nGreedy accuracy on the 64 held-out questions: {before:.3f} before; after "
        f"{args.steps} steps " + ", ".join(f"{after[n]:.3f} ({n})" for n in runs) +
        f". Step time (median of steps 2-N): DPO {dpo_s:.2f} s, SFT "
        f"on the same pairs' rows (both responses, unpacked) {sft_s:.2f} s, ratio "
        f"{dpo_s / sft_s:.2f}. SmolLM2-135M-Instruct, fp32, {PAIRS_PER_STEP} pairs per step, "
        f"lr {args.lr:g}, beta 0.1, 2 local ranks (DP2); held-out pairs: the 64 questions, "
        f"each with its answer chosen and a number 1-3 away rejected.")
    print(body)
    if args.append:
        append_entry(args.append, "DPO on a real model (SmolLM2-135M-Instruct, arithmetic "
                     "pairs)", f"python -m bench.bench_dpo --steps {args.steps} --lr {args.lr:g} "
                     f"--sft-weight {args.sft_weight:g}",
                     body)


if __name__ == "__main__":
    main()
