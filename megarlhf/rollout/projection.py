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
~1e-7 (1e-4 leaves room for any width); 16-bit: the engine's product is rounded to 8 (bf16)
or 11 (fp16) mantissa bits, up to 4e-3. A row changed by a whole ulp of 16-bit weights in
many entries, or by anything an actual fault does, is far above both.
"""

from __future__ import annotations

from typing import Iterator

import torch

from megarlhf.models.arch.registry import TensorRule
from megarlhf.rollout.engine import EngineError, WeightStream

VECTORS = 2
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}


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
                    self.products = products(tensor).cpu()
                    self.norms = tensor.detach().float().norm(dim=1).cpu()
                    self.vector_norms = vectors(tensor.shape[1]).norm(dim=0)
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
        bad = (error > TOLERANCE[dtype]).any(1).nonzero().flatten() + start
        if bad.numel():
            raise EngineError(
                f"{engine_name}: after the weight sync its output projection differs from the "
                f"synced {self.name} in {bad.numel()} vocabulary row(s) (first "
                f"{bad[:5].tolist()}; largest error {float(error.max()):.3g}, tolerance "
                f"{TOLERANCE[dtype]:g}): it would sample from other weights than the actor's")


def products(weight: torch.Tensor) -> torch.Tensor:
    """A [V, H] projection's products with the probe vectors, [V, VECTORS] float32."""
    return weight.detach().float() @ vectors(weight.shape[1]).to(weight.device)
