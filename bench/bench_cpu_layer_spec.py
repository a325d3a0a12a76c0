"""The layer specs on CPU, side by side: `local` (megatron-core's attention as matmuls and a
softmax, GQA heads copied) against `sdpa` (torch's fused kernel), and the Megatron engine's
sampler against torch.multinomial. Why `auto` picks sdpa on CPU (models/specs.py).

On SmolLM2-135M-Instruct's shape (30 layers, hidden 576, 9 query / 3 KV heads, vocab 49152;
random weights: the time does not depend on them), one process, one thread (what each of the
recipe's two colocated ranks has):
1. Decode: the Megatron engine generating 4 prompts x 4 samples (60-token prompts) for
   `--new-tokens` tokens at temperature 1 with no stop token, so every sample runs to the
   end; seconds per decode step (the call's time / new tokens, the prefill included).
2. Train: one forward and backward of 4 causal rows of `--seq` tokens.
3. Sampling: one draw per row from [16, 49152] probabilities, `_draw` vs torch.multinomial.
Each round runs every variant once, in a fresh process per spec; best of `--rounds` rounds per
variant, the ratio sdpa / local from the best times.

    python -m bench.bench_cpu_layer_spec [--new-tokens 64] [--seq 316] [--rounds 3] [--append BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import time

import torch

from bench.report import append_entry
from megarlhf.parallel import launch_local

SPECS = ("local", "sdpa")
PROMPTS, SAMPLES, PROMPT_LEN, TRAIN_ROWS = 4, 4, 60, 4


def _model():
    from megarlhf.models.arch import architecture_for_hf_config
    from tests.real_model import smollm2_dir
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(smollm2_dir())
    arch, _ = architecture_for_hf_config(config, "SmolLM2-135M-Instruct")
    return arch.model_config(config)


def _rank(spec_name: str, new_tokens: int, seq: int) -> dict:
    from megarlhf.models.gpt import build_model, model_spec
    from megarlhf.parallel.mesh import ParallelConfig, init_mesh
    from megarlhf.rollout.engine import SamplingParams
    from megarlhf.rollout.megatron_engine import MegatronEngine, MegatronEngineConfig

    torch.set_num_threads(1)
    model, parallel = _model(), ParallelConfig()
    mesh = init_mesh(parallel)
    spec = model_spec(model, parallel, on_gpu=False, layer_spec=spec_name)
    engine = MegatronEngine(spec, mesh, MegatronEngineConfig(max_batch_size=64))
    engine._weights_ready = True  # random weights: speed does not depend on them
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.vocab_size, (PROMPT_LEN,), generator=g).tolist()
               for _ in range(PROMPTS)]
    engine.generate(prompts, SamplingParams(max_new_tokens=4, n=SAMPLES, seed=1))  # warm-up
    t0 = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_new_tokens=new_tokens, n=SAMPLES, seed=1))
    decode = (time.perf_counter() - t0) / new_tokens
    engine.shutdown()

    (chunk,) = build_model(spec, mesh)
    tokens = torch.randint(0, model.vocab_size, (TRAIN_ROWS, seq), generator=g)
    positions = torch.arange(seq).repeat(TRAIN_ROWS, 1)
    mask = ~torch.ones(seq, seq, dtype=torch.bool).tril()[None, None].repeat(TRAIN_ROWS, 1, 1, 1)
    times = []
    for _ in range(2):  # the first warms up
        t0 = time.perf_counter()
        chunk(tokens, positions, mask).float().sum().backward()
        times.append(time.perf_counter() - t0)
    return {"decode": decode, "train": times[-1]}


def _sampling(rounds: int) -> dict:
    from megarlhf.rollout.megatron_engine import _draw

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(3 * torch.randn(PROMPTS * SAMPLES, 49152, generator=g), dim=-1)
    best = {}
    for name, draw in (("_draw", lambda: _draw(probs, g)),
                       ("multinomial", lambda: torch.multinomial(probs, 1, generator=g))):
        draw()
        times = []
        for _ in range(rounds * 10):
            t0 = time.perf_counter()
            draw()
            times.append(time.perf_counter() - t0)
        best[name] = min(times)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--seq", type=int, default=316)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--append", default=None, help="append the result to this file")
    args = parser.parse_args()
    runs = {name: [] for name in SPECS}
    for _ in range(args.rounds):
        for name in SPECS:
            runs[name].append(launch_local(_rank, 1, name, args.new_tokens, args.seq,
                                           env={"OMP_NUM_THREADS": "1"})[0])
    best = {name: {k: min(r[k] for r in rs) for k in ("decode", "train")}
            for name, rs in runs.items()}
    draw = _sampling(args.rounds)
    lines = ["| measure | local | sdpa | sdpa / local |", "|---|---|---|---|"]
    for key, label in (("decode", f"decode step, {PROMPTS * SAMPLES} rows (s)"),
                       ("train", f"forward + backward, {TRAIN_ROWS} x {args.seq} (s)")):
        lo, sd = best["local"][key], best["sdpa"][key]
        lines.append(f"| {label} | {lo:.4f} | {sd:.4f} | {sd / lo:.2f} |")
    body = "\n".join(lines) + (
        f"\n\nSampling one id per row of [{PROMPTS * SAMPLES}, 49152]: _draw "
        f"{draw['_draw'] * 1e3:.2f} ms, torch.multinomial {draw['multinomial'] * 1e3:.2f} ms "
        f"({draw['_draw'] / draw['multinomial']:.2f}x).\n\nSmolLM2-135M-Instruct's shape, "
        f"random fp32 weights, one process with one thread per variant; decode: "
        f"{args.new_tokens} new tokens after {PROMPT_LEN}-token prompts, the call's time per "
        f"new token; best of {args.rounds} rounds, variants alternating within a round.")
    print(body)
    if args.append:
        append_entry(args.append, "CPU layer specs: local vs sdpa, and the engine's sampler",
                     f"python -m bench.bench_cpu_layer_spec --new-tokens {args.new_tokens} "
                     f"--seq {args.seq} --rounds {args.rounds}", body)


if __name__ == "__main__":
    main()
