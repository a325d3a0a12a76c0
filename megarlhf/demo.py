"""`megarlhf demo` (`make demo`): the three alignment stages on embedded data, 4 local CPU ranks.

    tokenizer  SentencePiece trained on the embedded text
    1. SFT     a tiny Llama-style model learns to answer prompts (TP2 x PP2)
    2. RM      a reward model, started from the SFT model, learns which of two answers people
               preferred: warm words over cold ones (TP2 x PP2)
    3. PPO     the SFT model is the actor and the frozen reference; the reward model scores
               rollouts and also seeds the critic (TP2 x DP2: generation runs at PP1)

The preference is learnable but SFT does not teach it (half its answers are warm, half cold),
so the reward PPO earns and the share of warm answers show the alignment working. Everything
goes through the same commands a user runs: `megarlhf sft|rm|ppo` configs, checkpoints on disk.
"""

from __future__ import annotations

import os
import shutil
import time

from megarlhf.data import synthetic
from megarlhf.data.config import DataConfig, DatasetSource
from megarlhf.data.prompts import load_prompts, write_prompt_cache
from megarlhf.data.tokenizer import load_tokenizer, train_sentencepiece
from megarlhf.engine.checkpoint import checkpoint_architecture, engine_from_checkpoint, read_meta
from megarlhf.engine.optim import OptimConfig
from megarlhf.parallel import launch_local
from megarlhf.parallel.mesh import ParallelConfig, init_mesh
from megarlhf.ppo import checkpoints
from megarlhf.ppo.config import PPOConfig
from megarlhf.ppo.controller import run as run_ppo
from megarlhf.ppo.plot import plot_run
from megarlhf.rollout.bridge import WeightBridge
from megarlhf.rollout.engine import SamplingParams
from megarlhf.rollout.megatron_engine import MegatronEngine, MegatronEngineConfig
from megarlhf.sft.config import LoopConfig, ModelSource, RMConfig, SFTConfig
from megarlhf.sft.rm import run_rm
from megarlhf.sft.sft import run_sft

MARKER = ".megarlhf-demo"
"""Marks a directory as the demo's own, so a re-run may replace it (and nothing else)."""
NPROC = 4
VOCAB = 256
MAX_LENGTH = 48
TP2_PP2 = ParallelConfig(tensor_parallel=2, pipeline_parallel=2)


def _data(path: str, tokenizer: str, **kw) -> DataConfig:
    return DataConfig(train=DatasetSource(path=path), tokenizer=tokenizer,
                      max_length=MAX_LENGTH, template="plain", **kw)


def sft_config(root: str, files: dict) -> SFTConfig:
    return SFTConfig(
        model=ModelSource(preset="tiny", overrides={"vocab_size": VOCAB}, layer_spec="local"),
        data=_data(files["sft"], files["tokenizer"], eval_fraction=0.05),
        train=LoopConfig(output_dir=os.path.join(root, "sft"), steps=150, global_batch_size=8,
                         micro_batch_size=2, eval_interval=50, log_interval=25),
        parallel=TP2_PP2, optim=OptimConfig(lr=3e-3, min_lr=3e-4, warmup_steps=5,
                                            decay_steps=150, clip_grad=1.0))


def rm_config(root: str, files: dict, sft_checkpoint: str) -> RMConfig:
    return RMConfig(
        model=ModelSource(checkpoint=sft_checkpoint, layer_spec="local"),
        data=DataConfig(train=DatasetSource(path=files["pairs"]),
                        eval=DatasetSource(path=files["heldout"]), max_length=MAX_LENGTH,
                        template="plain"),
        train=LoopConfig(output_dir=os.path.join(root, "rm"), steps=30, global_batch_size=16,
                         micro_batch_size=4, eval_interval=30, log_interval=10),
        parallel=TP2_PP2, optim=OptimConfig(lr=2e-3, clip_grad=1.0))


def ppo_config(root: str, files: dict, sft_checkpoint: str, rm_checkpoint: str,
               eos_id: int) -> PPOConfig:
    return PPOConfig(
        actor=sft_checkpoint, critic=rm_checkpoint, reward_model=rm_checkpoint,
        prompts=files["prompts"], out_dir=os.path.join(root, "ppo"), nproc=NPROC,
        tensor_parallel=2, steps=12, prompts_per_step=8, samples_per_prompt=2,
        max_new_tokens=20, stop_token_ids=(eos_id,), ppo_epochs=2, mini_batches=2,
        actor_lr=1e-3, critic_lr=1e-3, kl_coef=0.05, seed=0)


def write_data(root: str) -> dict:
    """The embedded records as JSONL, a SentencePiece model trained on the embedded text, and
    the PPO prompts as token ids."""
    data = os.path.join(root, "data")
    os.makedirs(data)
    files = {
        "tokenizer": train_sentencepiece(synthetic.tokenizer_corpus(),
                                         os.path.join(data, "sp.model"), vocab_size=VOCAB),
        "sft": synthetic.write_jsonl(synthetic.sft_records(400), os.path.join(data, "sft.jsonl")),
        "pairs": synthetic.write_jsonl(synthetic.preference_records(400, seed=1),
                                       os.path.join(data, "pairs.jsonl")),
        "heldout": synthetic.write_jsonl(synthetic.preference_records(200, seed=11),
                                         os.path.join(data, "heldout.jsonl")),
    }
    # PPO trains on one set of prompts; the before/after comparison uses others.
    for name, seed in (("prompts", 2), ("eval_prompts", 5)):
        text = synthetic.write_jsonl(synthetic.prompt_records(64, seed=seed),
                                     os.path.join(data, f"{name}_text.jsonl"))
        files[name] = os.path.join(data, f"{name}.jsonl")
        prompts, _ = load_prompts(DatasetSource(path=text),
                                  lambda: load_tokenizer(files["tokenizer"]),
                                  template="plain")
        write_prompt_cache(prompts, files[name], tokenizer_path=files["tokenizer"],
                           source=text)
    return files


def sample_rank(checkpoints: list[str], prompts: list[list[int]],
                params: SamplingParams) -> list[list[list[int]]]:
    """Responses of each checkpoint's policy, generated the way PPO's rollouts are (Megatron
    engine fed by the weight bridge), on one rank."""
    mesh = init_mesh(ParallelConfig())
    out = []
    for checkpoint in checkpoints:
        trainer = engine_from_checkpoint(checkpoint, ParallelConfig(), mesh)
        arch = checkpoint_architecture(read_meta(checkpoint))
        engine = MegatronEngine(trainer.spec, mesh, MegatronEngineConfig(architecture=arch.name))
        engine.update_weights(WeightBridge(trainer.chunks, mesh, trainer.spec.model,
                                           arch).stream())
        out.append([c.token_ids for c in engine.generate(prompts, params)])
    return out


def _fresh_dir(root: str) -> None:
    if os.path.exists(root):
        if not os.path.isfile(os.path.join(root, MARKER)):
            raise SystemExit(f"{root} exists and is not a demo output; choose another --out")
        shutil.rmtree(root)
    os.makedirs(root)
    open(os.path.join(root, MARKER), "w").close()


def _last(history: list[dict], split: str) -> dict:
    return [r for r in history if r["split"] == split][-1]


def _stage(title: str):
    print(f"\n== {title}", flush=True)
    return time.perf_counter()


def main(out_dir: str = "demo_out") -> dict:
    """Run the pipeline; returns the figures it printed (tests check them)."""
    root = os.path.abspath(out_dir)
    _fresh_dir(root)
    began = time.perf_counter()

    t = _stage("tokenizer + embedded data")
    files = write_data(root)
    eos_id = load_tokenizer(files["tokenizer"]).eos_id
    print(f"SentencePiece ({VOCAB} tokens) and data in {root}/data "
          f"[{time.perf_counter() - t:.0f} s]")

    t = _stage(f"1. SFT: tiny Llama-style model, TP2 x PP2 on {NPROC} CPU ranks")
    sft = launch_local(run_sft, NPROC, sft_config(root, files), timeout_s=900)[0]
    sft_first, sft_eval = _last(sft["history"][:1], "train"), _last(sft["history"], "eval")
    print(f"SFT loss {sft_first['loss']:.3f} -> held-out {sft_eval['loss']:.3f} "
          f"[{time.perf_counter() - t:.0f} s]")

    t = _stage(f"2. reward model from the SFT checkpoint, TP2 x PP2 on {NPROC} CPU ranks")
    rm = launch_local(run_rm, NPROC, rm_config(root, files, sft["checkpoint"]),
                      timeout_s=900)[0]
    rm_eval = _last(rm["history"], "eval")
    print(f"RM held-out accuracy {rm_eval['accuracy']:.1%} on {rm_eval['pairs']} pairs "
          f"[{time.perf_counter() - t:.0f} s]")

    t = _stage(f"3. PPO: actor + ref (SFT), critic + reward (RM), TP2 x DP2 on {NPROC} CPU ranks")
    config = ppo_config(root, files, sft["checkpoint"], rm["checkpoint"], eos_id)
    history = run_ppo(config)
    print(f"[{time.perf_counter() - t:.0f} s]")

    print("\nstep  reward  kl       response length")
    for m in history:
        print(f"{m['step']:4d}  {m['reward/mean']:+.3f}  {m['kl']:+.4f}  "
              f"{m['response_length']:.1f}")
    png = plot_run(config.out_dir)
    first = sum(m["reward/mean"] for m in history[:3]) / 3
    last = sum(m["reward/mean"] for m in history[-3:]) / 3
    print(f"\nreward (mean of 3 steps) {first:+.3f} -> {last:+.3f}; curves: {png}")

    t = _stage("before and after PPO, on held-out prompts")
    tokenizer = load_tokenizer(files["tokenizer"])
    prompts = [list(p.ids) for p in load_prompts(DatasetSource(path=files["eval_prompts"]),
                                                 None)[0]]
    params = SamplingParams(max_new_tokens=config.max_new_tokens, temperature=1.0, seed=7,
                            stop_token_ids=(eos_id,))
    ppo_actor = os.path.join(checkpoints.of_run(config.out_dir).latest(), "actor")
    before, after = launch_local(sample_rank, 1, [sft["checkpoint"], ppo_actor], prompts,
                                 params)[0]
    warm = {name: sum(synthetic.is_warm(tokenizer.decode(r)) for r in responses)
            for name, responses in (("SFT", before), ("PPO", after))}
    for name, count in warm.items():
        print(f"{name}: {count}/{len(prompts)} answers use warm words")
    for prompt, a, b in list(zip(prompts, before, after))[:3]:
        print(f"  {tokenizer.decode(prompt)!r}\n    SFT: {tokenizer.decode(a)!r}\n"
              f"    PPO: {tokenizer.decode(b)!r}")
    print(f"[{time.perf_counter() - t:.0f} s]")
    print(f"demo finished in {time.perf_counter() - began:.0f} s; outputs in {root}")
    if not last > first:
        raise SystemExit("demo FAILED: the reward did not rise")
    print("demo OK")
    return {"sft_eval_loss": sft_eval["loss"], "rm_eval_accuracy": rm_eval["accuracy"],
            "reward_first": first, "reward_last": last, "warm_sft": warm["SFT"],
            "warm_ppo": warm["PPO"], "answers": len(prompts), "plot": png}
