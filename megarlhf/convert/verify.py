"""Check a Megatron checkpoint against its HF source: same tokens through HF transformers and
through our Megatron model at a given layout; compare logits (LM) or scores (value head).

Tolerance: both sides compute in fp32 from the same weights; they differ only in summation
order (fused vs separate QKV/MLP matmuls, attention kernels), which moves logits by ~1e-6 on the
toy models. The default 1e-4 is far below what any mapping error produces (>= 1e-2).
"""

from __future__ import annotations

import dataclasses

import torch
import transformers

from megarlhf.engine.checkpoint import engine_from_checkpoint, read_meta
from megarlhf.engine.losses import gather_logits
from megarlhf.engine.schedule import gather_rows, rank_microbatches
from megarlhf.models.config import ModelConfig
from megarlhf.models.transformer_config import parse_dtype
from megarlhf.parallel import launch_local
from megarlhf.parallel.mesh import DistEnv, ParallelConfig, init_mesh

DEFAULT_TOLERANCE = 1e-4


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    kind: str
    """'logits' (causal LM) or 'scores' (value head at the last non-pad token)."""
    max_abs_diff: float
    top1_agreement: float | None
    tolerance: float
    layout: str

    @property
    def passed(self) -> bool:
        return self.max_abs_diff <= self.tolerance

    def __str__(self) -> str:
        top1 = "" if self.top1_agreement is None else f", top-1 agreement {self.top1_agreement:.4f}"
        verdict = "PASS" if self.passed else "FAIL"
        return (f"{verdict} {self.kind} at {self.layout}: max |diff| {self.max_abs_diff:.3e} "
                f"(tolerance {self.tolerance:.0e}){top1}")


def checkpoint_outputs(ckpt: str, parallel: ParallelConfig, tokens_BT: torch.Tensor, *,
                       dtype: str = "fp32", microbatches: int = 1,
                       layer_spec: str = "auto") -> torch.Tensor:
    """Per-rank: logits [B, T, vocab] (or values [B, T]) of a checkpoint's model for the
    global batch `tokens_BT`, on every rank."""
    meta = read_meta(ckpt)
    model = ModelConfig.from_dict(meta["model"])
    value_head = meta["value_head"]
    mesh = init_mesh(parallel)
    engine = engine_from_checkpoint(ckpt, parallel, mesh, dtype=parse_dtype(dtype),
                                    layer_spec=layer_spec)

    def keep_output(mb, out):
        if not value_head:
            out = gather_logits(out, mesh, model.vocab_size)
        return torch.zeros(()), torch.ones((), dtype=torch.int), {"out": out.detach().float()}

    seq = tokens_BT.shape[1]
    batch = {"tokens": tokens_BT, "position_ids": torch.arange(seq).expand_as(tokens_BT)}
    out = engine.forward(rank_microbatches(batch, mesh, microbatches), keep_output)
    return gather_rows(out, "out", mesh)


def verification_batch(vocab_size: int, *, batch: int, seq_len: int, seed: int,
                       pad_id: int | None) -> torch.Tensor:
    """Random tokens; with a pad id, row i > 0 is right-padded after (i+1)/(batch+1) of T."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch, seq_len), generator=g)
    if pad_id is not None:
        tokens[tokens == pad_id] = (pad_id + 1) % vocab_size
        for i in range(1, batch):
            tokens[i, max(1, seq_len * (i + 1) // (batch + 1)):] = pad_id
    return tokens


def hf_outputs(hf_dir: str, tokens_BT: torch.Tensor, *, value_head: bool,
               pad_id: int | None) -> torch.Tensor:
    """HF transformers' own forward: logits [B, T, V] or scores [B]."""
    if value_head:
        model = transformers.AutoModelForSequenceClassification.from_pretrained(
            hf_dir, dtype=torch.float32)
        mask = (tokens_BT != pad_id).long()
        with torch.no_grad():
            return model(input_ids=tokens_BT, attention_mask=mask).logits[:, 0].float()
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(input_ids=tokens_BT).logits.float()


def compare(hf_out: torch.Tensor, ours: torch.Tensor, tokens_BT: torch.Tensor, *,
            value_head: bool, pad_id: int | None, tolerance: float, layout: str) -> VerifyReport:
    if value_head:
        # Our values are per token; HF scores the last non-pad token of each right-padded row.
        last = (tokens_BT != pad_id).sum(dim=1) - 1
        ours = ours[torch.arange(ours.shape[0]), last]
        return VerifyReport("scores", (ours - hf_out).abs().max().item(), None, tolerance, layout)
    diff = (ours - hf_out).abs().max().item()
    top1 = (ours.argmax(-1) == hf_out.argmax(-1)).float().mean().item()
    return VerifyReport("logits", diff, top1, tolerance, layout)


def verify(hf_dir: str, ckpt: str, parallel: ParallelConfig, *, batch: int = 2,
           seq_len: int = 32, seed: int = 0, dtype: str = "fp32",
           tolerance: float = DEFAULT_TOLERANCE) -> VerifyReport:
    """Run both models and compare. Launches tp x pp local ranks (times the data-parallel
    replicas expert parallelism needs) unless already in a job started by a launcher
    (torchrun / srun), in which case every rank must call this."""
    meta = read_meta(ckpt)
    model, value_head = ModelConfig.from_dict(meta["model"]), meta["value_head"]
    model.check_parallel(parallel)
    if batch % parallel.min_data_parallel:
        raise ValueError(f"batch={batch} rows do not split over the "
                         f"{parallel.min_data_parallel} data-parallel replicas that expert_parallel "
                         f"x expert_tensor_parallel needs at this layout; use a multiple of "
                         f"{parallel.min_data_parallel}")
    pad_id = None
    if value_head:
        pad_id = transformers.AutoConfig.from_pretrained(hf_dir).pad_token_id
        if pad_id is None:
            raise ValueError(f"{hf_dir}/config.json has no pad_token_id; HF sequence "
                             f"classification needs one to find the last token; add the tokenizer's pad id there")
    tokens = verification_batch(model.vocab_size, batch=batch, seq_len=seq_len, seed=seed,
                                pad_id=pad_id)
    layout = (f"TP{parallel.tensor_parallel}xPP{parallel.pipeline_parallel}"
              + (f"xVPP{parallel.virtual_pipeline_parallel}"
                 if parallel.virtual_pipeline_parallel else "")
              + (f"xEP{parallel.expert_parallel}" if parallel.expert_parallel > 1 else "")
              + (f"xETP{parallel.expert_tp}" if parallel.expert_parallel > 1
                 and parallel.expert_tp > 1 else ""))
    if DistEnv.detect().world_size > 1:  # started by torchrun / srun: we are one of the ranks
        ours = checkpoint_outputs(ckpt, parallel, tokens, dtype=dtype)
    else:
        world = parallel.replica_size * parallel.min_data_parallel
        ours = launch_local(checkpoint_outputs, world, ckpt, parallel, tokens, dtype=dtype)[0]
    reference = hf_outputs(hf_dir, tokens, value_head=value_head, pad_id=pad_id)
    return compare(reference, ours, tokens, value_head=value_head, pad_id=pad_id,
                   tolerance=tolerance, layout=layout)
