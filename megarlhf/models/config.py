"""Architecture of a Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2, Qwen3, and the
mixture-of-experts Qwen3-MoE and Mixtral), independent of how it is parallelised, and its checks
against a parallel layout."""

from __future__ import annotations

import dataclasses
import math

import torch

from megarlhf.models.vision.qwen2_5_vl import VisionConfig
from megarlhf.parallel.mesh import ParallelConfig

ROPE_SCALING_TYPES = ("llama3", "linear")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RopeScaling:
    """RoPE frequency scaling as HF configs spell it (`rope_scaling` / `rope_parameters`)."""

    rope_type: str = "llama3"
    """'llama3' (Llama 3.1+ wavelength-dependent scaling) or 'linear' (position interpolation)."""
    factor: float = 8.0
    low_freq_factor: float = 1.0
    """llama3 only: wavelengths above original_max_position_embeddings / this are scaled fully."""
    high_freq_factor: float = 4.0
    """llama3 only: wavelengths below original_max_position_embeddings / this are not scaled."""
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in ROPE_SCALING_TYPES:
            raise ValueError(
                f"unsupported RoPE scaling type {self.rope_type!r}; supported: {ROPE_SCALING_TYPES}"
            )
        if self.factor <= 0:
            raise ValueError(f"RoPE scaling factor must be > 0, got {self.factor}")
        if self.rope_type == "llama3" and self.high_freq_factor <= self.low_freq_factor:
            raise ValueError(
                f"RoPE high_freq_factor ({self.high_freq_factor}) must exceed low_freq_factor "
                f"({self.low_freq_factor})"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelConfig:
    vocab_size: int
    """Tokenizer vocabulary size (before padding for TP)."""
    hidden_size: int
    ffn_hidden_size: int
    """Width of the SwiGLU MLP (HF `intermediate_size`)."""
    num_layers: int
    num_attention_heads: int
    num_kv_heads: int | None = None
    """Key/value heads for grouped-query attention; None means multi-head (= attention heads)."""
    head_dim: int | None = None
    """Per-head width; None means hidden_size // num_attention_heads (Qwen3 sets it apart)."""
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""
    qkv_bias: bool = False
    """Bias on the Q, K, V projections (Qwen2)."""
    qk_norm: bool = False
    """RMSNorm on each head's queries and keys before RoPE (Qwen3)."""
    tie_embeddings: bool = False
    """Output layer shares the input embedding matrix (small Qwen2/Llama-3.2 models)."""
    make_vocab_size_divisible_by: int = 128
    """The embedding is padded to a multiple of this times TP; padding rows are never sampled."""
    init_std: float = 0.02
    num_experts: int | None = None
    """Routed experts of every layer's MLP (mixture of experts); None: a dense model."""
    moe_ffn_hidden_size: int | None = None
    """Width of each expert's SwiGLU MLP (HF `moe_intermediate_size`; Mixtral's experts are
    `intermediate_size` wide)."""
    moe_router_topk: int = 2
    """Experts each token is sent to."""
    moe_norm_topk: bool = True
    """Renormalise the top-k routing weights to sum to 1 (Mixtral; Qwen3-MoE's
    `norm_topk_prob`); False keeps the softmax over all experts (Qwen2-MoE)."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing auxiliary loss in training (HF `router_aux_loss_coef`)."""
    mrope_section: tuple[int, ...] | None = None
    """M-RoPE (Qwen2.5-VL): how many rotary pairs turn with the temporal, height and width
    position (HF `rope_parameters.mrope_section`; they sum to head_dim / 2); positions are then
    [3, B, S] (models/vision/mrope.py). None: 1D RoPE."""
    vision: VisionConfig | None = None
    """The vision tower of a vision-language model (Qwen2.5-VL), run by the first pipeline
    stage on the images; None: a text-only model."""
    image_token_id: int | None = None
    """Placeholder token whose embeddings the vision tower's features replace (with `vision`)."""

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "ffn_hidden_size", "num_layers",
                     "num_attention_heads", "make_vocab_size_divisible_by"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_kv_heads ({self.kv_heads})"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                f"({self.num_attention_heads}); set head_dim explicitly"
            )
        if self.kv_channels % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.kv_channels}")
        if self.num_experts is not None:
            for name in ("num_experts", "moe_ffn_hidden_size", "moe_router_topk"):
                value = getattr(self, name)
                if not isinstance(value, int) or value < 1:
                    raise ValueError(f"ModelConfig.{name} must be a positive integer for a "
                                     f"mixture-of-experts model, got {value!r}")
            if self.moe_router_topk > self.num_experts:
                raise ValueError(f"moe_router_topk ({self.moe_router_topk}) exceeds num_experts "
                                 f"({self.num_experts})")
            if self.moe_aux_loss_coeff < 0:
                raise ValueError(f"moe_aux_loss_coeff must be >= 0, got "
                                 f"{self.moe_aux_loss_coeff}")
        if self.mrope_section is not None and 2 * sum(self.mrope_section) != self.kv_channels:
            raise ValueError(f"mrope_section {list(self.mrope_section)} must sum to head_dim / 2 "
                             f"= {self.kv_channels // 2}")
        if self.vision is not None and (self.image_token_id is None or self.mrope_section is None):
            raise ValueError("a model with a vision tower needs image_token_id and mrope_section")

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_attention_heads

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    def padded_vocab_size(self, tensor_parallel: int) -> int:
        multiple = self.make_vocab_size_divisible_by * tensor_parallel
        return math.ceil(self.vocab_size / multiple) * multiple

    def check_parallel(self, parallel: ParallelConfig, *, training: bool = False) -> None:
        """Raise ValueError if this architecture cannot be split as `parallel` asks (to be
        trained, with `training`)."""
        tp, pp, vpp = parallel.tensor_parallel, parallel.pipeline_parallel, parallel.num_chunks
        if self.num_attention_heads % tp:
            raise ValueError(
                f"tensor_parallel={tp} does not divide num_attention_heads="
                f"{self.num_attention_heads}; choose a TP that divides it"
            )
        if self.kv_heads % tp:
            raise ValueError(
                f"tensor_parallel={tp} does not divide num_kv_heads={self.kv_heads}; choose a TP "
                f"that divides the KV heads (KV-head replication is not supported)"
            )
        if not self.is_moe and self.ffn_hidden_size % tp:
            raise ValueError(
                f"tensor_parallel={tp} does not divide ffn_hidden_size={self.ffn_hidden_size}"
            )
        ep, etp = parallel.expert_parallel, parallel.expert_tp
        if not self.is_moe and (ep > 1 or parallel.expert_tensor_parallel is not None):
            raise ValueError(f"expert_parallel={ep} / expert_tensor_parallel="
                             f"{parallel.expert_tensor_parallel} need a mixture-of-experts "
                             f"model; this one is dense: leave them unset")
        if self.is_moe and self.num_experts % ep:
            raise ValueError(f"expert_parallel={ep} does not divide num_experts="
                             f"{self.num_experts}; choose an EP that divides it")
        if training and self.is_moe and tp > 1 and not parallel.sequence_parallel:
            raise ValueError(f"a mixture-of-experts model trains at tensor_parallel={tp} only "
                             f"with sequence_parallel=True (megatron-core's MoE layer refuses "
                             f"otherwise); set it")
        if self.is_moe and self.moe_ffn_hidden_size % etp:
            raise ValueError(f"expert_tensor_parallel={etp} does not divide the experts' "
                             f"width moe_ffn_hidden_size={self.moe_ffn_hidden_size}")
        if self.num_layers % (pp * vpp):
            raise ValueError(
                f"num_layers={self.num_layers} is not divisible by pipeline_parallel x "
                f"virtual_pipeline_parallel = {pp} x {vpp} = {pp * vpp}; choose sizes whose "
                f"product divides the layer count"
            )

    def to_dict(self) -> dict:
        """JSON-ready form, stored in checkpoints so they can be exported without a recipe."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        unknown = set(d) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise ValueError(f"unknown ModelConfig fields {sorted(unknown)}")
        scaling, mrope, vision = d.get("rope_scaling"), d.get("mrope_section"), d.get("vision")
        return cls(**{**d, "rope_scaling": RopeScaling(**scaling) if scaling else None,
                      "mrope_section": tuple(mrope) if mrope else None,
                      "vision": VisionConfig.from_dict(vision) if vision else None})

    def rope_inv_freq(self) -> torch.Tensor:
        """Inverse RoPE frequencies [head_dim/2], with scaling applied, in fp32."""
        dim = self.kv_channels
        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        scaling = self.rope_scaling
        if scaling is not None and scaling.rope_type == "linear":
            inv_freq = inv_freq / scaling.factor
        elif scaling is not None:
            # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band
            # between interpolated smoothly in 1/wavelength.
            old_len = scaling.original_max_position_embeddings
            wavelen = 2 * math.pi / inv_freq
            smooth = (old_len / wavelen - scaling.low_freq_factor) / (
                scaling.high_freq_factor - scaling.low_freq_factor
            )
            smoothed = (1 - smooth) * inv_freq / scaling.factor + smooth * inv_freq
            inv_freq = torch.where(
                wavelen > old_len / scaling.low_freq_factor,
                inv_freq / scaling.factor,
                torch.where(wavelen < old_len / scaling.high_freq_factor, inv_freq, smoothed),
            )
        return inv_freq.float()
