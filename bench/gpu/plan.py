"""What the GPU benchmark runs on this machine, at what size, and why it skips the rest.

Only cheap checks here (no CUDA kernels, no import of vLLM or Transformer Engine): the plan is
printed before anything heavy starts, so a missing piece is named up front.
"""

from __future__ import annotations

import dataclasses
import importlib.util

import torch

from megarlhf.models.config import ModelConfig
from megarlhf.models.presets import preset

NO_CUDA = "no CUDA device (torch.cuda.is_available() is False)"
NO_TE = "transformer_engine is not installed (pip install transformer-engine[pytorch])"
NO_VLLM = "vllm is not installed (pip install vllm)"
# In a dry run everything is on CPU, and Transformer Engine's modules are CUDA-only.
TE_NEEDS_GPU = "Transformer Engine's layer spec runs on a GPU only"


@dataclasses.dataclass(frozen=True)
class Machine:
    cuda: bool
    gpu_name: str | None
    te: bool
    vllm: bool

    @classmethod
    def detect(cls) -> "Machine":
        cuda = torch.cuda.is_available()
        return cls(cuda=cuda, gpu_name=torch.cuda.get_device_name(0) if cuda else None,
                   te=importlib.util.find_spec("transformer_engine") is not None,
                   vllm=importlib.util.find_spec("vllm") is not None)

    def describe(self) -> str:
        yes = {True: "yes", False: "no"}
        return (f"CUDA: {self.gpu_name or 'no'}; transformer_engine: {yes[self.te]}; "
                f"vllm: {yes[self.vllm]}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Sizes:
    """Every measurement's size. FULL is the GPU run; DRY only exercises the code."""

    dtype: torch.dtype
    """Training / rollout / bridge dtype (parity is always fp32)."""
    train_preset: str
    train_seq: int
    micro_batch: int
    microbatches: int
    """Micro-batches per step: one step is micro_batch x microbatches sequences."""
    warmup_steps: int
    steps: int
    parity_preset: str
    parity_seq: int
    parity_rows: int
    gen_preset: str
    gen_head_dim: int | None
    """Replaces the preset's head_dim when set: vLLM's CPU attention has no kernel for the
    tiny preset's 16, so the dry run generates with 64 (both engines, the same model)."""
    gen_prompts: int
    gen_prompt_len: int
    gen_new_tokens: int
    gen_calls: int
    """Timed generate() calls after one warm-up call; the best counts."""
    kv_cache_bytes: int
    """vLLM's KV cache (ours is sized by the batch itself)."""
    sync_preset: str
    bucket_bytes: int
    sync_rounds: int
    ppo_preset: str
    ppo_steps: int
    ppo_new_tokens: int
    offload_preset: str
    offload_seq: int
    rl_rows: int
    rl_seq: int
    rl_tokens_per_mb: int

    def gen_model(self) -> ModelConfig:
        model = preset(self.gen_preset)
        return dataclasses.replace(model, head_dim=self.gen_head_dim) if self.gen_head_dim \
            else model

    def gen_label(self) -> str:
        return self.gen_preset + (f" (head_dim {self.gen_head_dim})" if self.gen_head_dim
                                  else "")


FULL = Sizes(
    dtype=torch.bfloat16, train_preset="llama-1b", train_seq=4096, micro_batch=1,
    microbatches=8, warmup_steps=2, steps=5,
    parity_preset="tiny", parity_seq=128, parity_rows=4,
    gen_preset="llama-1b", gen_head_dim=None, gen_prompts=64, gen_prompt_len=128,
    gen_new_tokens=128, gen_calls=2,
    kv_cache_bytes=4 * 1024**3,
    sync_preset="llama-1b", bucket_bytes=512 * 1024**2, sync_rounds=5,
    ppo_preset="tiny", ppo_steps=3, ppo_new_tokens=32,
    offload_preset="llama-1b", offload_seq=512,
    rl_rows=64, rl_seq=2048, rl_tokens_per_mb=16384,
)
DRY = Sizes(
    dtype=torch.float32, train_preset="tiny", train_seq=32, micro_batch=2, microbatches=1,
    warmup_steps=0, steps=1,
    parity_preset="tiny", parity_seq=32, parity_rows=2,
    gen_preset="tiny", gen_head_dim=64, gen_prompts=2, gen_prompt_len=4, gen_new_tokens=4,
    gen_calls=1,
    kv_cache_bytes=64 * 1024**2,
    sync_preset="tiny", bucket_bytes=64 * 1024, sync_rounds=1,
    ppo_preset="tiny", ppo_steps=1, ppo_new_tokens=4,
    offload_preset="tiny", offload_seq=32,
    rl_rows=4, rl_seq=32, rl_tokens_per_mb=64,
)


@dataclasses.dataclass(frozen=True)
class Item:
    key: str
    title: str
    needs_te: bool = False
    needs_vllm: bool = False


ITEMS = (
    Item("mfu-sdpa", "1a. training MFU, SDPA spec"),
    Item("mfu-te", "1b. training MFU, Transformer Engine spec", needs_te=True),
    Item("parity", "2. CPU vs GPU parity, fp32"),
    Item("gen-megatron", "3a. generation, Megatron engine"),
    Item("gen-vllm", "3b. generation, vLLM engine", needs_vllm=True),
    Item("bridge", "4. weight bridge sync vs device copy_"),
    Item("ppo", "5. GRPO through the controller, one rank"),
    Item("offload", "6. offload round trip, pinned host memory"),
    Item("rl-phase", "7. RL training phase: the actor's old-logprob pass and update"),
    Item("profile", "8. profile: true on a GPU rank (GRPO, step 2 profiled)"),
)


def gpu_skip(item: Item, machine: Machine) -> str | None:
    """Why a GPU run on this machine would skip `item` (None: it runs)."""
    if not machine.cuda:
        return NO_CUDA
    if item.needs_te and not machine.te:
        return NO_TE
    if item.needs_vllm and not machine.vllm:
        return NO_VLLM
    return None


def dry_skip(item: Item, machine: Machine) -> str | None:
    """Why the dry run (CPU, tiny sizes) skips `item` (None: it runs)."""
    if item.needs_te:
        return TE_NEEDS_GPU if machine.te else f"{TE_NEEDS_GPU}; {NO_TE}"
    if item.needs_vllm and not machine.vllm:
        return NO_VLLM
    return None
