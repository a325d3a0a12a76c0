"""Build the Megatron GPT model chunks one rank holds: a causal LM, or a value model.

A rank holds one chunk per virtual pipeline stage (one chunk without interleaving). Chunk i of
pipeline rank r owns layers [(i*pp + r) * n, (i*pp + r + 1) * n) with n = layers / (pp*vpp).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from megatron.core import parallel_state as ps
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group

from megarlhf.compat.megatron import LogitPositionsHook, PostprocessHook
from megarlhf.models.config import ModelConfig
from megarlhf.models.layers import ValueHead
from megarlhf.models.lora import LoraConfig, check_model, freeze_base, init_adapters
from megarlhf.models.specs import block_spec, resolve_layer_spec
from megarlhf.models.transformer_config import to_transformer_config
from megarlhf.models.vision.qwen2_5_vl import Qwen25VisionTower, VisionConfig
from megarlhf.parallel.mesh import Mesh, ParallelConfig


class GPTLMModel(LogitPositionsHook, GPTModel):
    """GPT causal LM whose LM head can run at chosen positions only (`logits_at`)."""


def _unwrapped(chunk: torch.nn.Module) -> GPTModel:
    """The GPT model inside a chunk's wrappers (DDP, Float16Module)."""
    while not isinstance(chunk, GPTModel):
        chunk = chunk.module
    return chunk


@contextlib.contextmanager
def logits_at(chunk: torch.nn.Module, positions: torch.Tensor | None):
    """Within the block, an LM chunk (possibly wrapped: DDP, Float16Module) makes logits only
    at sequence `positions` [n] (None: everywhere); a value model's chunk is unchanged."""
    model = _unwrapped(chunk) if positions is not None else None
    if not isinstance(model, GPTLMModel):
        yield
        return
    model.logit_positions = positions
    try:
        yield
    finally:
        model.logit_positions = None


@contextlib.contextmanager
def rotary_at(chunk: torch.nn.Module, columns: torch.Tensor | None):
    """Within the block, the chunk's RoPE rotates sequence position s by the angle of position
    `columns[s]` [S] (None: by s itself, megatron-core's rule). A row that continues one
    prompt several times (roles/batching.py, shared prompts) places each continuation at the
    columns the prompt's own row would: every query-key offset, all RoPE depends on, is then
    the sequence's own. Every pipeline stage computes its rotary embedding, so every chunk
    takes the columns."""
    if columns is None:
        yield
        return
    rotary = _unwrapped(chunk).rotary_pos_emb
    # megatron-core's RotaryEmbedding.forward(seq_len, ...) gives [S, 1, 1, d] for positions
    # 0..S-1; an instance attribute shadows the (cached) method for this forward only.
    whole = rotary.forward
    rotary.forward = lambda *args, **kwargs: whole(*args, **kwargs).index_select(0, columns)
    try:
        yield
    finally:
        del rotary.forward


class GPTVLModel(GPTLMModel):
    """A vision-language LM (Qwen2.5-VL). The first pipeline stage's chunk also holds the vision
    tower (a full replica on every TP rank) and puts its features in place of the image
    placeholder tokens' word embeddings; every stage takes M-RoPE position ids [3, B, S]
    (models/vision/mrope.py) where a text model takes [B, S]. Images come in through
    `images_at`, so the forward signature stays megatron-core's."""

    def __init__(self, *, vision: VisionConfig, image_token_id: int, **kwargs):
        super().__init__(**kwargs)
        self.image_token_id = image_token_id
        self.images: tuple[torch.Tensor, torch.Tensor] | None = None
        if self.pre_process:
            self.vision = Qwen25VisionTower(vision)
            # Spliced into the word embeddings' output (whole rows, [B, S, H], already reduced
            # over TP), before megatron-core's embedding transposes it, scatters it for
            # sequence parallelism and applies dropout: image tokens then go through exactly
            # what text tokens do.
            self.embedding.word_embeddings.register_forward_hook(self._splice_images)

    def _splice_images(self, module, args, embeddings: torch.Tensor) -> torch.Tensor | None:
        if self.images is None:
            return None
        pixel_values, grid_thw = self.images
        slots = args[0] == self.image_token_id
        features = self.vision(pixel_values, grid_thw)
        if features.shape[0] != int(slots.sum()):
            raise ValueError(f"the images give {features.shape[0]} image tokens, the rows hold "
                             f"{int(slots.sum())} placeholders (token {self.image_token_id})")
        # Rows of `features` fill the placeholders in row-major order: images in order.
        return embeddings.masked_scatter(slots[..., None], features.to(embeddings.dtype))


@contextlib.contextmanager
def images_at(chunk: torch.nn.Module, pixel_values: torch.Tensor | None,
              grid_thw: torch.Tensor | None):
    """Within the block, a vision-language chunk (possibly wrapped) embeds these images
    (pixel_values [patches, C*T*P*P] and grid_thw [images, 3], as the HF image processor gives
    them for the whole micro-batch) at its placeholder tokens. A chunk of a later pipeline
    stage has no tower and ignores them; None: no images."""
    model = _unwrapped(chunk) if pixel_values is not None else None
    if model is None or not model.pre_process:
        yield
        return
    if not isinstance(model, GPTVLModel):
        raise ValueError("images were given to a text-only model")
    model.images = (pixel_values, grid_thw)
    try:
        yield
    finally:
        model.images = None


class GPTValueModel(PostprocessHook, GPTModel):
    """GPT trunk with a scalar head instead of the LM head: values [b, s] on the last stage.

    The LM output layer is never tied here (there is none), so a critic or reward model made
    from a tied-embedding LM keeps its embedding on the first stage only and needs no
    first/last-stage embedding sync.
    """

    def __init__(self, **kwargs):
        super().__init__(**kwargs, share_embeddings_and_output_weights=False)
        if self.post_process:
            del self.output_layer
            self.value_head = ValueHead(self.config)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        # There is no LM head, so none of LanguageModule's output-layer tying logic applies.
        metadata = ensure_metadata_has_dp_cp_group(metadata)
        return MegatronModule.sharded_state_dict(self, prefix, sharded_offsets, metadata)

    def postprocess(self, hidden_states):
        if not self.post_process:
            return hidden_states
        return self.value_head(hidden_states)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSpec:
    """What to build: architecture, megatron config, resolved layer spec, LM or value head."""

    model: ModelConfig
    transformer: TransformerConfig
    layer_spec: str
    value_head: bool = False
    lora: LoraConfig | None = None
    """Adapters on the linear layers, base frozen (models/lora.py); None trains every
    weight."""


def model_spec(model: ModelConfig, parallel: ParallelConfig, *, value_head: bool = False,
               dtype: torch.dtype = torch.float32, layer_spec: str = "auto",
               on_gpu: bool | None = None, recompute: str = "none",
               lora: LoraConfig | None = None) -> ModelSpec:
    """The ModelSpec of `model` at `parallel` (with its sequence parallelism); `on_gpu`
    defaults to whether CUDA is present; `recompute`: activation recomputation in training
    (none, full, selective: to_transformer_config); `lora`: adapters, base frozen."""
    on_gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
    if value_head and model.vision is not None:
        raise ValueError("a value head on a vision-language model (critic / reward) is not "
                         "supported yet; use a text-only model for that role")
    if model.vision is not None and (parallel.sequence_parallel or parallel.context_parallel > 1):
        # The image features are spliced into whole [B, S] rows of word embeddings: a
        # sequence-parallel or context-parallel rank holds only part of its rows' tokens.
        raise ValueError("a vision-language model runs without sequence_parallel and with "
                         "context_parallel=1 for now")
    if lora is not None:
        check_model(lora, is_moe=model.is_moe)
    return ModelSpec(
        model=model,
        transformer=to_transformer_config(model, parallel, dtype=dtype, on_gpu=on_gpu,
                                          recompute=recompute),
        layer_spec=resolve_layer_spec(layer_spec, on_gpu=on_gpu,
                                      context_parallel=parallel.context_parallel),
        value_head=value_head,
        lora=lora,
    )


def build_model(spec: ModelSpec, mesh: Mesh, *, meta: bool = False) -> list[GPTModel]:
    """The model chunks of this rank, on `mesh.device`, in train mode.

    `meta=True` builds them on the meta device: shapes, names and checkpoint layout without
    memory (converters and the memory planner use this for models of any size).
    """
    vpp = mesh.config.virtual_pipeline_parallel
    stages = range(vpp) if vpp else [None]
    cls, extra = _model_class(spec)
    device = torch.device("meta") if meta else mesh.device
    config = spec.transformer
    chunks = []
    for vp_stage in stages:
        with torch.device("meta") if meta else contextlib.nullcontext():
            chunk = cls(
                config=config,
                transformer_layer_spec=block_spec(
                    spec.layer_spec, config, qk_norm=spec.model.qk_norm,
                    vp_stage=vp_stage, pp_rank=mesh.pp_rank, lora=spec.lora,
                ),
                vocab_size=spec.model.padded_vocab_size(mesh.tp),
                max_sequence_length=spec.model.max_position_embeddings,
                pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
                post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
                position_embedding_type="mrope" if spec.model.mrope_section else "rope",
                rotary_base=spec.model.rope_theta,
                parallel_output=True,
                vp_stage=vp_stage,
                **extra,
            )
        # megatron-core's RoPE scaling hard-codes Llama 3.1's constants; ours follows the
        # checkpoint's own (Llama 3.2 and others differ). M-RoPE's rotary has the same
        # inv_freq (its sections only choose which position each pair turns with).
        chunk.rotary_pos_emb.inv_freq = spec.model.rope_inv_freq().to(device)
        if spec.lora is not None:
            freeze_base(chunk, trainable_head=spec.value_head)
            init_adapters(chunk)
        chunks.append(chunk.to(device))
    return chunks


def _model_class(spec: ModelSpec) -> tuple[type[GPTModel], dict]:
    """The chunk class of `spec` and its own constructor arguments."""
    if spec.value_head:
        return GPTValueModel, {}
    tied = {"share_embeddings_and_output_weights": spec.model.tie_embeddings}
    if spec.model.vision is not None:
        return GPTVLModel, {**tied, "vision": spec.model.vision,
                            "image_token_id": spec.model.image_token_id}
    return GPTLMModel, tied
