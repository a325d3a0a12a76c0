"""3. Generation tokens/s of the rollout engines: MegatronEngine, and vLLM when it imports.

Each engine gets a trainer model's weights through the weight bridge (as in training), then
generates greedily for the same random prompts with no stop tokens, so every sample runs
exactly max_new_tokens and both engines do the same work. One warm-up call (CUDA kernels,
vLLM's graphs), then the best of the timed calls. tokens/s = generated tokens / call time,
prefill included (what a rollout step costs).
"""

from __future__ import annotations

import json
import os
import tempfile

from bench.gpu.common import (
    ONE_RANK, Row, dtype_name, gpu_memory_gib, mesh_here, random_prompts, source_chunks, timed,
)
from bench.gpu.plan import Sizes

# VLLMEngine runs vLLM in the training process (weights pass by reference); it checks this.
VLLM_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
# vLLM's config dump and caught warm-up tracebacks (INFO / WARNING) would bury the table:
# megarlhf keeps library logs at ERROR (megarlhf/logs.py; MEGARLHF_LIBRARY_LOGS=info shows them).


def _timed_generation(engine, sizes: Sizes, vocab: int, device) -> dict:
    from megarlhf.rollout.engine import SamplingParams

    prompts = random_prompts(vocab, sizes.gen_prompts, sizes.gen_prompt_len)
    params = SamplingParams(max_new_tokens=sizes.gen_new_tokens, temperature=0)
    warmup_s = timed(lambda: engine.generate(prompts, params), device)
    outputs = []
    times = [timed(lambda: outputs.append(engine.generate(prompts, params)), device)
             for _ in range(sizes.gen_calls)]
    return {"best_s": min(times), "warmup_s": warmup_s,
            "tokens": sum(len(c.token_ids) for c in outputs[-1]),
            "memory": gpu_memory_gib(device)}


def megatron_rank(sizes: Sizes) -> dict:
    from megarlhf.models.arch import architecture
    from megarlhf.models.gpt import model_spec
    from megarlhf.rollout.bridge import WeightBridge
    from megarlhf.rollout.megatron_engine import MegatronEngine, MegatronEngineConfig

    mesh, on_gpu = mesh_here()
    model = sizes.gen_model()
    chunks = source_chunks(model, sizes.dtype, mesh, on_gpu)
    bridge = WeightBridge(chunks, mesh, model, architecture("llama"))
    # 'sdpa', not 'te': the engine refuses TE (its padding masks are unverified there).
    spec = model_spec(model, ONE_RANK, dtype=sizes.dtype, layer_spec="sdpa", on_gpu=on_gpu)
    engine = MegatronEngine(spec, mesh, MegatronEngineConfig(max_batch_size=sizes.gen_prompts))
    engine.update_weights(bridge.stream(reuse_buffer=engine.copies_each_bucket))
    del bridge, chunks  # the trainer's copy is not needed while generating
    return {**_timed_generation(engine, sizes, model.vocab_size, mesh.device), "spec": "sdpa"}


def _hf_dir(directory: str, model) -> str:
    """config.json only: vLLM starts with dummy weights and gets ours through the bridge."""
    from megarlhf.models.arch import architecture

    config = architecture("llama").hf_config(model)
    config.update(architectures=["LlamaForCausalLM"])
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return directory


def vllm_rank(sizes: Sizes) -> dict:
    from megarlhf.models.arch import architecture
    from megarlhf.rollout.bridge import WeightBridge

    for key, value in VLLM_ENV.items():
        os.environ.setdefault(key, value)
    try:  # installed is not the same as importable (a wheel for another CUDA or torch)
        import vllm  # noqa: F401

        from megarlhf.rollout.vllm_engine import VLLMEngine, VLLMEngineConfig
    except Exception as e:  # noqa: BLE001 - any import failure is a skip, not a crash
        return {"skipped": f"vllm failed to import: {type(e).__name__}: {e}"}
    mesh, on_gpu = mesh_here()
    model = sizes.gen_model()
    chunks = source_chunks(model, sizes.dtype, mesh, on_gpu)
    bridge = WeightBridge(chunks, mesh, model, architecture("llama"), dtype=sizes.dtype)
    with tempfile.TemporaryDirectory() as tmp:
        engine = VLLMEngine(VLLMEngineConfig(
            model_dir=_hf_dir(tmp, model), dtype=dtype_name(sizes.dtype),
            max_model_len=sizes.gen_prompt_len + sizes.gen_new_tokens,
            kv_cache_memory_bytes=sizes.kv_cache_bytes,
            # CUDA graphs are most of vLLM's decode speed on a GPU; on CPU eager starts faster.
            enforce_eager=not on_gpu))
        try:
            engine.update_weights(bridge.stream(reuse_buffer=engine.copies_each_bucket))
            del bridge, chunks
            out = _timed_generation(engine, sizes, model.vocab_size, mesh.device)
        finally:
            engine.shutdown()
    return {**out, "spec": "vLLM, CUDA graphs" if on_gpu else "vLLM, eager"}


def measure(sizes: Sizes, run, backend: str) -> list[Row]:
    if backend == "vllm":
        out = run(vllm_rank, sizes, env=VLLM_ENV)
    else:
        out = run(megatron_rank, sizes)
    if "skipped" in out:
        return [("", "", f"skipped: {out['skipped']}")]
    setting = (f"{sizes.gen_label()}, {dtype_name(sizes.dtype)}, {sizes.gen_prompts} prompts x "
               f"{sizes.gen_prompt_len} tokens, {sizes.gen_new_tokens} new, greedy, "
               f"{out['spec']}")
    result = (f"{out['tokens'] / out['best_s']:,.0f} tokens/s ({out['tokens']} tokens in "
              f"{out['best_s']:.3f} s, best of {sizes.gen_calls}; warm-up call "
              f"{out['warmup_s']:.2f} s); peak memory {out['memory']}")
    return [("", setting, result)]
