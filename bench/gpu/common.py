"""Helpers the measurements share: a one-rank mesh, timing that waits for the GPU, batches,
prompts, and a trainer model to stream weights from."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from megarlhf.models.config import ModelConfig
from megarlhf.models.gpt import build_model, model_spec
from megarlhf.parallel import ParallelConfig, init_mesh

ONE_RANK = ParallelConfig()
Row = tuple[str, str, str]
"""(part, setting, result): one line of the results table; `part` tells apart the lines of
one measurement ("" when it has one line)."""


def mesh_here():
    """This process's one-rank mesh (its GPU, or the CPU) and whether it is a GPU."""
    mesh = init_mesh(ONE_RANK, seed=0)
    return mesh, mesh.device.type == "cuda"


def synchronize(device: torch.device) -> None:
    # CUDA kernels run asynchronously: without a sync a timer measures the launch only.
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device) -> float:
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def median(times: list[float]) -> float:
    return statistics.median(times)


def random_batch(vocab: int, rows: int, seq: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """A next-token batch of uniform random ids: throughput does not depend on the text, and
    the byte corpus (megarlhf.data.embedded) is shorter than a 4096-token window."""
    g = torch.Generator().manual_seed(seed)
    window = torch.randint(0, vocab, (rows, seq + 1), generator=g)
    return {"tokens": window[:, :-1].contiguous(), "labels": window[:, 1:].contiguous(),
            "loss_mask": torch.ones(rows, seq),
            "position_ids": torch.arange(seq).expand(rows, seq).contiguous()}


def random_prompts(vocab: int, count: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (count, length), generator=g).tolist()


def source_chunks(model: ModelConfig, dtype: torch.dtype, mesh, on_gpu: bool):
    """A frozen trainer model (its init weights) to stream into engines through the bridge,
    as training hands its weights to rollouts."""
    spec = model_spec(model, ONE_RANK, dtype=dtype, layer_spec="sdpa", on_gpu=on_gpu)
    chunks = build_model(spec, mesh)
    for chunk in chunks:
        chunk.requires_grad_(False)
    return chunks


def gpu_memory_gib(device: torch.device) -> str:
    if device.type != "cuda":
        return "n/a (CPU)"
    return f"{torch.cuda.max_memory_allocated(device) / 2**30:.1f} GiB"


def params_label(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
