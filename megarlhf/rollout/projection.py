"""After every weight sync, the output projection a rollout engine computes with, read back
through its own kernels, held to the tensor the sync streamed into it.

The logprob-gap guards only see tokens somebody sampled: a vocabulary row the engine loaded
wrong (a stale prepacked copy, as vLLM's CPU lm_head once kept of a tied embedding, or a row
pushed so low that it is never drawn) biases every sample without showing in their
logprobs. So each sync passes its stream through a `Recorder`, which takes the products of
the streamed projection (V x H) with K fixed random vectors as it goes by; the engine then
returns the same products computed with its own weights for its vocabulary rows, and any
row whose products differ by more than the dtype's rounding is named.

Error per row and vector: |engine - streamed| / (|row| x |vector|), which bounds a dot
product's rounding independently of its value. fp32: a GEMM's summation order moves it by
~1e-7 (1e-4 leaves room for any width; 1e-3 where the process lets fp32 matmuls run in TF32,
as vLLM's VLLM_FLOAT32_MATMUL_PRECISION can); 16-bit: the engine's product is rounded to 8
(bf16) or 11 (fp16) mantissa bits, up to 4e-3. Gross faults (a stale, missing, shifted or
scaled row) are far above both; a row off by an ulp or two in scattered entries is not seen.

Products are taken in blocks of rows, in float32, so a 128k x 8k projection adds a few hundred
MB to the sync rather than a float32 copy of itself.
"""

from __future__ import annotations

from typing import Iterator

import torch

from megarlhf.models.arch.registry import TensorRule
from megarlhf.rollout.engine import EngineError, WeightStream

VECTORS = 2
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}
TF32_TOLERANCE = 1e-3
_BLOCK_ROWS = 8192


def output_name(rules: list[TensorRule], tie_embeddings: bool) -> str:
    """The HF name of the tensor the LM head computes with: its own, or the embedding's when
    tied (a tied model streams no head)."""
    mcore = "embedding.word_embeddings.weight" if tie_embeddings else "output_layer.weight"
    (rule,) = [r for r in rules if r.mcore == mcore]
    return rule.hf[0]


def vectors(hidden: int) -> torch.Tensor:
    """The fixed probe vectors, [hidden, VECTORS] float32 (the same on every rank)."""
    return torch.randn(hidden, VECTORS, generator=torch.Generator().manual_seed(0))


class Recorder:
    """Passes a weight stream through, keeping the streamed projection's products and row
    norms (float32, on the host) when its tensor goes by."""

    def __init__(self, name: str):
        self.name = name
        self.products: torch.Tensor | None = None
        self.norms: torch.Tensor | None = None
        self.vector_norms: torch.Tensor | None = None

    def wrap(self, buckets: WeightStream) -> Iterator[list[tuple[str, torch.Tensor]]]:
        for bucket in buckets:
            for name, tensor in bucket:
                if name == self.name:
                    probe = vectors(tensor.shape[1])
                    self.products = products(tensor, probe)
                    self.norms = torch.cat([
                        torch.linalg.vector_norm(block, dim=1, dtype=torch.float32).cpu()
                        for block in tensor.detach().split(_BLOCK_ROWS)])
                    self.vector_norms = probe.norm(dim=0)
            yield bucket  # a reused buffer is only overwritten after this

    def check(self, engine_name: str, start: int, engine_products: torch.Tensor,
              dtype: torch.dtype) -> None:
        """`engine_products`: the engine's [rows, VECTORS] for its vocabulary rows start..;
        EngineError naming the rows that differ from the streamed tensor's."""
        if self.products is None:
            raise EngineError(f"{engine_name}: the weight sync carried no {self.name}")
        rows = engine_products.shape[0]
        scale = self.norms[start:start + rows, None] * self.vector_norms
        error = (engine_products.float().cpu() - self.products[start:start + rows]).abs() \
            / scale.clamp_min(torch.finfo(torch.float32).tiny)
        tolerance = TOLERANCE[dtype]
        if dtype == torch.float32 and torch.get_float32_matmul_precision() != "highest":
            tolerance = TF32_TOLERANCE
        bad = (error > tolerance).any(1).nonzero().flatten() + start
        if bad.numel():
            raise EngineError(
                f"{engine_name}: after the weight sync its output projection differs from the "
                f"synced {self.name} in {bad.numel()} vocabulary row(s) (first "
                f"{bad[:5].tolist()}; largest error {float(error.max()):.3g}, tolerance "
                f"{tolerance:g}): it would sample from other weights than the actor's")


@torch.no_grad()
def products(weight: torch.Tensor, probe: torch.Tensor) -> torch.Tensor:
    """A [V, H] projection's products with the [H, K] probe, [V, K] float32 on the host,
    block by block (no float32 copy of the whole projection)."""
    probe = probe.to(weight.device)
    return torch.cat([(block.float() @ probe).cpu() for block in weight.split(_BLOCK_ROWS)])
