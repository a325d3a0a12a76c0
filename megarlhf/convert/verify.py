"""Check a Megatron checkpoint against its HF source: same tokens through HF transformers and
through our Megatron model at a given layout; compare logits (LM) or scores (value head).

The reference is HF's forward in float64, not in fp32: HF's fp32 forward has rounding error of
its own (with transformers 5.19, SmolLM2-135M's fp32 logits are 1.6e-4 from its float64
logits), so judging ours against it would fail a correct conversion whose fp32 rounding merely
differs from HF's. Both fp32 forwards differ from float64 only by summation order (fused vs
separate QKV/MLP matmuls, tensor-parallel partial sums, attention kernels): ~1e-6 on the toy
models, ~1e-4 on a 30-layer model; a mapping error moves logits by >= 1e-2. The rule is in
VerifyReport.bound.

Memory: HF runs on CPU in the calling process, after our ranks have exited, as one model loaded
in fp32 and then cast to float64 in place: 8 bytes per parameter at the peak (64 GB for an 8B
model). Under torchrun / srun every rank runs it.

A vision-language model (ModelConfig.vision) is checked on rows that hold images
(`with_images`): random pixel values and placeholder tokens, M-RoPE positions, the vision tower
on both sides. HF's vision rotary rounds q and k to fp32 even in its float64 forward
(apply_rotary_pos_emb_vision): a ~1e-7 relative rounding, far below what is judged here.
"""

from __future__ import annotations

import dataclasses

import torch
import transformers
from megatron.core.pipeline_parallel import get_forward_backward_func

from megarlhf.engine.checkpoint import engine_from_checkpoint, read_meta
from megarlhf.engine.losses import gather_logits
from megarlhf.engine.schedule import gather_rows, outputs_from_last_stage, rank_microbatches
from megarlhf.models.config import ModelConfig
from megarlhf.models.gpt import images_at
from megarlhf.models.transformer_config import parse_dtype
from megarlhf.models.vision.mrope import mrope_position_ids
from megarlhf.models.vision.qwen2_5_vl import VisionConfig
from megarlhf.parallel import launch_local
from megarlhf.parallel.mesh import DistEnv, ParallelConfig, init_mesh

DEFAULT_TOLERANCE = 1e-4
HF_FP32_FACTOR = 2.0
"""Ours passes at up to this multiple of HF's own fp32 error. Ours and HF's fp32 forward are two
fp32 evaluations of the same weights with different summation orders: their errors against
float64 have the same size but are not equal, since each is the largest of many rounding
errors and ours adds steps HF lacks (tensor-parallel partial sums, fused matmuls). On SmolLM2
ours is 0.87x HF's at TP3 x PP2 (1.37e-4 vs 1.57e-4) and 0.56x at TP1; 2x leaves room for
inputs where the ratio goes above 1, while a mapping error (>= 1e-2) stays 30x above 2x the
fp32 error of a 30-layer model (3.1e-4). 1.5x would leave little room over the 0.87x."""


@dataclasses.dataclass(frozen=True)
class VerifyReport:
    kind: str
    """'logits' (causal LM) or 'scores' (value head at the last non-pad token)."""
    ours_diff: float
    """max |ours - HF float64|."""
    hf_fp32_diff: float
    """max |HF fp32 - HF float64|: how far HF's own fp32 forward is from the reference."""
    top1_agreement: float | None
    """Share of positions where our argmax equals HF float64's (logits only)."""
    tolerance: float
    layout: str

    @property
    def bound(self) -> float:
        """Ours passes within the tolerance of float64, or when no worse than HF's own fp32
        forward (up to HF_FP32_FACTOR, see there): a conversion cannot be asked to be closer
        to float64 than transformers' own fp32 forward is."""
        return max(self.tolerance, HF_FP32_FACTOR * self.hf_fp32_diff)

    @property
    def passed(self) -> bool:
        return self.ours_diff <= self.bound  # False for NaN

    def __str__(self) -> str:
        top1 = "" if self.top1_agreement is None else f"; top-1 agreement {self.top1_agreement:.4f}"
        verdict = "PASS" if self.passed else "FAIL"
        return (f"{verdict} {self.kind} at {self.layout}: max |diff| from HF float64: "
                f"ours {self.ours_diff:.2e}, HF fp32 {self.hf_fp32_diff:.2e}{top1}\n"
                f"  rule: ours <= max(tolerance {self.tolerance:.1e}, "
                f"{HF_FP32_FACTOR:g} x HF fp32) = {self.bound:.2e}")


@dataclasses.dataclass(frozen=True)
class ImageInputs:
    """The images of a batch for a vision-language model, as HF's image processor gives them
    for all rows, with the M-RoPE positions they give the tokens."""
    pixel_values: torch.Tensor
    """[patches, in_channels * temporal_patch_size * patch_size^2]"""
    grid_thw: torch.Tensor
    """[images, 3] in patches, the images in the order their placeholders appear, row by row."""
    position_ids: torch.Tensor
    """[3, B, T] (models/vision/mrope.py)."""


def checkpoint_outputs(ckpt: str, parallel: ParallelConfig, tokens_BT: torch.Tensor, *,
                       dtype: str = "fp32", microbatches: int = 1, layer_spec: str = "auto",
                       images: ImageInputs | None = None) -> torch.Tensor:
    """Per-rank: logits [B, T, vocab] (or values [B, T]) of a checkpoint's model for the
    global batch `tokens_BT` (with `images` for a vision-language model), on every rank."""
    mesh = init_mesh(parallel)
    engine = engine_from_checkpoint(ckpt, parallel, mesh, dtype=parse_dtype(dtype),
                                    layer_spec=layer_spec)
    if images is not None:
        if microbatches != 1:
            raise ValueError("a batch with images runs as one micro-batch")
        return engine_outputs_with_images(engine, tokens_BT, images)
    return engine_outputs(engine, tokens_BT, microbatches=microbatches)


def _keep_output(engine):
    """The loss closure's body that keeps the model's output: full-vocabulary logits (or
    values), fp32."""
    mesh, value_head = engine.mesh, engine.spec.value_head

    def keep(out):
        if not value_head:
            out = gather_logits(out, mesh, engine.spec.model.vocab_size)
        return torch.zeros(()), torch.ones((), dtype=torch.int), {"out": out.detach().float()}
    return keep


def engine_outputs(engine, tokens_BT: torch.Tensor, *, microbatches: int = 1) -> torch.Tensor:
    """Per-rank: logits [B, T, vocab] (or values [B, T]) of an engine's model for the global
    batch `tokens_BT`, on every rank."""
    keep = _keep_output(engine)
    seq = tokens_BT.shape[1]
    batch = {"tokens": tokens_BT, "position_ids": torch.arange(seq).expand_as(tokens_BT)}
    out = engine.forward(rank_microbatches(batch, engine.mesh, microbatches),
                         lambda mb, out: keep(out))
    return gather_rows(out, "out", engine.mesh)


def engine_outputs_with_images(engine, tokens_BT: torch.Tensor,
                               images: ImageInputs) -> torch.Tensor:
    """Per-rank: logits [B, T, vocab] of a vision-language engine's model for the batch
    `tokens_BT` and its `images`, on every rank. The whole batch runs as one micro-batch on
    every data-parallel replica, through megatron-core's pipeline schedule called here:
    engine.forward cuts batches into micro-batches by rows and has no place for images, whose
    patches are not per row (issue 66's integration)."""
    mesh, keep = engine.mesh, _keep_output(engine)
    tokens, positions, pixels = (t.to(mesh.device) for t in
                                 (tokens_BT, images.position_ids, images.pixel_values))

    def forward_step(data_iterator, model):
        next(data_iterator)
        # Every stage takes the [3, B, T] positions; only the first has the tower.
        with images_at(model, pixels, images.grid_thw):
            return model(tokens, positions, None), keep

    chunks = engine.chunks
    for chunk in chunks:
        chunk.eval()
    with torch.no_grad():
        out = get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=[iter([None]) for _ in chunks] if len(chunks) > 1 else iter([None]),
            model=chunks if len(chunks) > 1 else chunks[0], num_microbatches=1,
            seq_length=tokens.shape[1], micro_batch_size=tokens.shape[0], forward_only=True)
    return outputs_from_last_stage(out, mesh)[0]["out"]


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


def verification_grids(vision: VisionConfig) -> torch.Tensor:
    """grid_thw [2, 3] of the two images every verification row holds: 2 x (w+1) and (w+1) x 2
    merged tokens for windows of w x w merged tokens, so the windowed blocks split each image
    into a whole and a cut-short window (by columns, then by rows) and attend in an order that
    differs from the raster order the full-attention blocks and the placeholders use."""
    merge = vision.spatial_merge_size
    window = vision.window_size // merge // vision.patch_size
    return torch.tensor([[1, 2 * merge, (window + 1) * merge],
                         [1, (window + 1) * merge, 2 * merge]])


def with_images(tokens_BT: torch.Tensor, model: ModelConfig, hf_config, *,
                seed: int) -> tuple[torch.Tensor, ImageInputs]:
    """The random rows `tokens_BT` with two random images in each (verification_grids), at
    places drawn per row from `seed`: each image's placeholder tokens, inside HF's
    vision_start / vision_end tokens where its config has them, overwrite text tokens, with
    text before, between and after. Text tokens that are one of HF's image/video/vision ids
    become another token. Pixel values are standard normal, as normalised images roughly are."""
    vision, merge = model.vision, model.vision.spatial_merge_size
    g = torch.Generator().manual_seed(seed + 1)  # not verification_batch's stream
    batch, seq = tokens_BT.shape
    grids = verification_grids(vision)
    start, end = (getattr(hf_config, f"vision_{k}_token_id", None) for k in ("start", "end"))
    wrap = start is not None and end is not None
    spans = [[start] * wrap + [model.image_token_id] * (t * h * w // merge ** 2) + [end] * wrap
             for t, h, w in grids.tolist()]
    text = seq - sum(map(len, spans))
    if text < 3:
        raise ValueError(f"seq_len={seq} is too short for the two images a vision-language model "
                         f"is verified on ({seq - text} tokens) and 3 text tokens around them; "
                         f"use --seq-len {seq - text + 3} or more")
    special = {model.image_token_id, start, end, getattr(hf_config, "video_token_id", None)}
    special.discard(None)
    tokens = tokens_BT.clone()
    tokens[torch.isin(tokens, torch.tensor(sorted(special)))] = \
        min(set(range(len(special) + 1)) - special)
    for row in tokens:
        # Text runs before, between and after the images: two cuts in 1..text-1.
        before, between = (torch.randperm(text - 1, generator=g)[:2] + 1).sort().values.tolist()
        pieces = row[:text].split([before, between - before, text - between])
        row[:] = torch.cat([pieces[0], torch.tensor(spans[0]), pieces[1],
                            torch.tensor(spans[1]), pieces[2]])
    grid_thw = grids.repeat(batch, 1)
    patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
    pixel_values = torch.randn(int(grid_thw.prod(1).sum()), patch_dim, generator=g)
    positions, _ = mrope_position_ids(tokens, grid_thw, image_token_id=model.image_token_id,
                                      spatial_merge_size=merge)
    return tokens, ImageInputs(pixel_values, grid_thw, positions)


@dataclasses.dataclass(frozen=True)
class HFOutputs:
    """HF transformers' forward of the same tokens: logits [B, T, V] or scores [B]."""
    fp32: torch.Tensor
    """What users of the HF model get."""
    fp64: torch.Tensor
    """The reference both fp32 forwards are judged against."""


def _hf_forward(model, tokens_BT: torch.Tensor, *, value_head: bool, pad_id: int | None,
                images: ImageInputs | None = None) -> torch.Tensor:
    with torch.no_grad():
        if value_head:
            mask = (tokens_BT != pad_id).long()
            return model(input_ids=tokens_BT, attention_mask=mask).logits[:, 0]
        if images is None:
            return model(input_ids=tokens_BT).logits
        # HF computes its own M-RoPE positions only when given the token types its processor
        # emits (1: image); without them it silently falls back to 1D positions.
        types = (tokens_BT == model.config.image_token_id).int()
        return model(input_ids=tokens_BT, pixel_values=images.pixel_values,
                     image_grid_thw=images.grid_thw, mm_token_type_ids=types).logits


def hf_outputs(hf_dir: str, tokens_BT: torch.Tensor, *, value_head: bool,
               pad_id: int | None, images: ImageInputs | None = None) -> HFOutputs:
    """HF transformers' own forward in fp32 and in float64, on CPU, of the tokens (with
    `images`: of a vision-language model, through its vision tower). One model: loaded in fp32,
    then cast in place (exact), so the peak is the float64 copy, 8 bytes per parameter."""
    cls = (transformers.AutoModelForSequenceClassification if value_head
           else transformers.AutoModelForImageTextToText if images is not None
           else transformers.AutoModelForCausalLM)
    model = cls.from_pretrained(hf_dir, dtype=torch.float32)
    args = dict(value_head=value_head, pad_id=pad_id, images=images)
    fp32 = _hf_forward(model, tokens_BT, **args).float()
    _to_float64(model)
    fp64 = _hf_forward(model, tokens_BT, **args)
    return HFOutputs(fp32, fp64)


def _to_float64(model) -> None:
    """Cast in place onto kernels that take float64. HF's default experts kernel of MoE layers
    (grouped_mm, transformers 5) refuses float64; its eager per-expert loop computes the same.
    HF still builds RoPE cos/sin in fp32 (its rotary embedding calls .float()), by the formula
    both fp32 forwards use (Megatron's too), so that shared rounding stays out of the errors
    compared; float64 tables would add ~3e-5 to both on SmolLM2."""
    model.to(torch.float64)
    if hasattr(model, "set_experts_implementation"):  # transformers >= 5; a no-op without MoE
        model.set_experts_implementation("eager")


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def compare(hf: HFOutputs, ours: torch.Tensor, tokens_BT: torch.Tensor, *,
            value_head: bool, pad_id: int | None, tolerance: float, layout: str) -> VerifyReport:
    if value_head:
        # Our values are per token; HF scores the last non-pad token of each right-padded row.
        last = (tokens_BT != pad_id).sum(dim=1) - 1
        ours = ours[torch.arange(ours.shape[0]), last]
    top1 = None if value_head else (ours.argmax(-1) == hf.fp64.argmax(-1)).float().mean().item()
    return VerifyReport("scores" if value_head else "logits", _max_abs_diff(ours, hf.fp64),
                        _max_abs_diff(hf.fp32, hf.fp64), top1, tolerance, layout)


def verify(hf_dir: str, ckpt: str, parallel: ParallelConfig, *, batch: int = 2,
           seq_len: int = 32, seed: int = 0, dtype: str = "fp32",
           tolerance: float = DEFAULT_TOLERANCE) -> VerifyReport:
    """Run both models and compare. Launches tp x pp local ranks (times the data-parallel
    replicas expert parallelism needs) unless already in a job started by a launcher
    (torchrun / srun), in which case every rank must call this."""
    meta = read_meta(ckpt)
    model, value_head = ModelConfig.from_dict(meta["model"]), meta["value_head"]
    if model.vision is not None and parallel.virtual_pipeline_parallel:
        raise ValueError("--vpp: a vision-language model is verified on one micro-batch "
                         "(its images), which the interleaved pipeline schedule refuses; "
                         "leave --vpp out")
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
    images = None
    if model.vision is not None:
        hf_config = transformers.AutoConfig.from_pretrained(hf_dir)
        tokens, images = with_images(tokens, model, hf_config, seed=seed)
    layout = (f"TP{parallel.tensor_parallel}xPP{parallel.pipeline_parallel}"
              + (f"xVPP{parallel.virtual_pipeline_parallel}"
                 if parallel.virtual_pipeline_parallel else "")
              + (f"xEP{parallel.expert_parallel}" if parallel.expert_parallel > 1 else "")
              + (f"xETP{parallel.expert_tp}" if parallel.expert_parallel > 1
                 and parallel.expert_tp > 1 else ""))
    if DistEnv.detect().world_size > 1:  # started by torchrun / srun: we are one of the ranks
        ours = checkpoint_outputs(ckpt, parallel, tokens, dtype=dtype, images=images)
    else:
        world = parallel.replica_size * parallel.min_data_parallel
        ours = launch_local(checkpoint_outputs, world, ckpt, parallel, tokens, dtype=dtype,
                            images=images)[0]
    reference = hf_outputs(hf_dir, tokens, value_head=value_head, pad_id=pad_id, images=images)
    return compare(reference, ours, tokens, value_head=value_head, pad_id=pad_id,
                   tolerance=tolerance, layout=layout)
