"""What Llama, Mistral, Qwen2, Qwen3 and their mixture-of-experts kin (Qwen3-MoE, Mixtral)
share: HF config translation and tensor rules.

HF keeps Q, K, V and gate, up as separate matrices; Megatron fuses them. Megatron's fused QKV
is grouped by KV head: for each of the `num_kv_heads` groups, that group's query heads, then its
key head, then its value head. TP splits this matrix by rows, so each TP rank holds whole groups.
The fused MLP input is [gate; up]. Both HF and Megatron rotate halves for RoPE (no permutation).
In an MoE layer the MLP is a router ([experts, hidden]) and one such [gate; up] / down MLP per
expert, which Megatron's checkpoint stacks on an expert axis after the layer axis.
"""

from __future__ import annotations

import dataclasses
import functools
import logging


from megarlhf.models.arch.registry import Architecture, TensorRule
from megarlhf.models.config import ModelConfig, RopeScaling

log = logging.getLogger(__name__)


def _fuse_qkv(m: ModelConfig):
    groups, d = m.kv_heads, m.kv_channels
    q_rows = m.num_attention_heads // groups * d

    def rows(tensors):  # per KV group: its query heads, its key head, its value head
        q, k, v = tensors
        return [block for g in range(groups)
                for block in (q[g * q_rows:(g + 1) * q_rows], k[g * d:(g + 1) * d],
                              v[g * d:(g + 1) * d])]

    def split(qkv):
        rest = qkv.shape[1:]
        q, k, v = qkv.reshape(groups, q_rows + 2 * d, *rest).split([q_rows, d, d], dim=1)
        return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]

    return rows, split


def _fuse_cat():
    def rows(tensors):
        return list(tensors)

    def split(fused):
        return [t.contiguous() for t in fused.chunk(2, dim=0)]

    return rows, split


def _same():
    return (lambda tensors: [tensors[0]]), (lambda t: [t.contiguous()])


def _rule(mcore, hf, shapes, fns, **flags) -> TensorRule:
    rows, split = fns
    return TensorRule(mcore=mcore, hf=tuple(hf), hf_shapes=tuple(shapes), rows=rows,
                      split=split, **flags)


@dataclasses.dataclass(frozen=True, kw_only=True)
class MoEFormat:
    """How an HF mixture-of-experts architecture names and configures its experts."""

    block: str
    """The layer's MoE module: 'mlp' (Qwen3-MoE) or 'block_sparse_moe' (Mixtral)."""
    gate_up_down: tuple[str, str, str]
    """Each expert's three projections, in the order gate, up, down."""
    experts_field: str
    """Config field of the expert count."""
    width_field: str
    """Config field of each expert's MLP width."""
    norm_field: str | None
    """Config field saying whether top-k weights are renormalised; None: always are."""

    def from_hf(self, c) -> dict:
        """Our ModelConfig's MoE fields from an HF config; refuses what we compute otherwise."""
        name = type(c).__name__
        if getattr(c, "mlp_only_layers", None) or getattr(c, "decoder_sparse_step", 1) != 1:
            raise ValueError(f"{name}: dense layers among the MoE layers (mlp_only_layers="
                             f"{c.mlp_only_layers}, decoder_sparse_step={c.decoder_sparse_step})"
                             f" are not supported; every layer must be an MoE layer")
        if getattr(c, "router_jitter_noise", 0.0):
            raise ValueError(f"{name}: router_jitter_noise={c.router_jitter_noise} (random "
                             f"router noise in training) is not supported; set it to 0")
        if getattr(c, "shared_expert_intermediate_size", 0):
            raise ValueError(f"{name}: shared experts are not supported")
        return dict(
            num_experts=getattr(c, self.experts_field),
            moe_ffn_hidden_size=getattr(c, self.width_field),
            moe_router_topk=c.num_experts_per_tok,
            moe_norm_topk=bool(getattr(c, self.norm_field)) if self.norm_field else True,
            # HF trains with the load-balancing loss only when it returns router logits.
            moe_aux_loss_coeff=float(c.router_aux_loss_coef)
            if getattr(c, "output_router_logits", False) else 0.0,
        )

    def to_hf(self, m: ModelConfig) -> dict:
        fields = {self.experts_field: m.num_experts, self.width_field: m.moe_ffn_hidden_size,
                  "num_experts_per_tok": m.moe_router_topk,
                  "router_aux_loss_coef": m.moe_aux_loss_coeff,
                  "output_router_logits": m.moe_aux_loss_coeff > 0}
        if self.norm_field:
            fields[self.norm_field] = m.moe_norm_topk
        return fields

    def fits(self, m: ModelConfig) -> bool:
        return m.is_moe and (self.norm_field is not None or m.moe_norm_topk)


def llama_family_rules(m: ModelConfig, *, lm_head: bool, value_head: bool,
                       moe: MoEFormat | None = None) -> list[TensorRule]:
    h, f, d = m.hidden_size, m.ffn_hidden_size, m.kv_channels
    q_out, kv_out = m.num_attention_heads * d, m.kv_heads * d
    rules = [_rule("embedding.word_embeddings.weight", ["model.embed_tokens.weight"],
                   [(m.vocab_size, h)], _same(), vocab=True)]

    def per_layer(mcore, hf, shapes, fns, **flags):
        rules.append(_rule("decoder.layers." + mcore, ["model.layers.{i}." + n for n in hf],
                           shapes, fns, **flags))

    per_layer("self_attention.linear_qkv.layer_norm_weight", ["input_layernorm.weight"],
              [(h,)], _same())
    qkv = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]
    per_layer("self_attention.linear_qkv.weight", [n + ".weight" for n in qkv],
              [(q_out, h), (kv_out, h), (kv_out, h)], _fuse_qkv(m))
    if m.qkv_bias:
        per_layer("self_attention.linear_qkv.bias", [n + ".bias" for n in qkv],
                  [(q_out,), (kv_out,), (kv_out,)], _fuse_qkv(m))
    if m.qk_norm:
        per_layer("self_attention.q_layernorm.weight", ["self_attn.q_norm.weight"], [(d,)],
                  _same())
        per_layer("self_attention.k_layernorm.weight", ["self_attn.k_norm.weight"], [(d,)],
                  _same())
    per_layer("self_attention.linear_proj.weight", ["self_attn.o_proj.weight"], [(h, q_out)],
              _same())
    per_layer("mlp.linear_fc1.layer_norm_weight", ["post_attention_layernorm.weight"], [(h,)],
              _same())
    if moe is None:
        per_layer("mlp.linear_fc1.weight", ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
                  [(f, h), (f, h)], _fuse_cat())
        per_layer("mlp.linear_fc2.weight", ["mlp.down_proj.weight"], [(h, f)], _same())
    else:
        fe, (gate, up, down) = m.moe_ffn_hidden_size, moe.gate_up_down
        expert = moe.block + ".experts.{e}."
        per_layer("mlp.router.weight", [moe.block + ".gate.weight"], [(m.num_experts, h)],
                  _same())
        per_layer("mlp.experts.experts.linear_fc1.weight",
                  [expert + gate + ".weight", expert + up + ".weight"], [(fe, h), (fe, h)],
                  _fuse_cat())
        per_layer("mlp.experts.experts.linear_fc2.weight", [expert + down + ".weight"],
                  [(h, fe)], _same())
    rules.append(_rule("decoder.final_layernorm.weight", ["model.norm.weight"], [(h,)], _same()))
    if lm_head and not m.tie_embeddings:
        rules.append(_rule("output_layer.weight", ["lm_head.weight"], [(m.vocab_size, h)],
                           _same(), vocab=True))
    if value_head:
        rules.append(_rule("value_head.linear.weight", ["score.weight"], [(1, h)], _same()))
    return rules


def rope_from_hf(c) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) from an HF config, whether it spells them the transformers-5 way
    (`rope_parameters`) or the older way (`rope_theta` + `rope_scaling`)."""
    params = dict(getattr(c, "rope_scaling", None) or {})
    params.update(getattr(c, "rope_parameters", None) or {})
    theta = params.get("rope_theta") or getattr(c, "rope_theta", None) or 10000.0
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return float(theta), None
    if kind == "linear":
        return float(theta), RopeScaling(rope_type="linear", factor=float(params["factor"]))
    if kind == "llama3":
        return float(theta), RopeScaling(
            rope_type="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    raise ValueError(
        f"RoPE type {kind!r} is not supported; supported: default, linear, llama3"
    )


def model_config_from_hf(c, *, qkv_bias: bool, qk_norm: bool, moe: MoEFormat | None = None,
                         make_vocab_size_divisible_by: int = 128) -> ModelConfig:
    """Our ModelConfig for a Llama-family HF config; refuses what we would compute differently."""
    name = type(c).__name__
    if getattr(c, "hidden_act", "silu") != "silu":
        raise ValueError(f"{name}: hidden_act={c.hidden_act!r} is not supported (only 'silu')")
    if getattr(c, "mlp_bias", False):
        raise ValueError(f"{name}: mlp_bias=True is not supported")
    if getattr(c, "attention_bias", False) and not qkv_bias:
        raise ValueError(f"{name}: attention_bias=True (bias on q/k/v/o projections) is not "
                         f"supported")
    theta, scaling = rope_from_hf(c)
    max_pos = c.max_position_embeddings
    window = _sliding_window(c)
    if window is not None and window < max_pos:
        # Our attention is always full-context; capping the context at the window keeps every
        # sequence we accept identical to HF's sliding-window attention.
        log.warning("%s uses sliding-window attention (window %d < max_position_embeddings %d); "
                    "max_position_embeddings is set to %d so results stay exact", name, window,
                    max_pos, window)
        max_pos = window
    return ModelConfig(
        vocab_size=c.vocab_size,
        hidden_size=c.hidden_size,
        ffn_hidden_size=c.intermediate_size,
        num_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_kv_heads=getattr(c, "num_key_value_heads", None) or c.num_attention_heads,
        head_dim=getattr(c, "head_dim", None) or None,
        max_position_embeddings=max_pos,
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=c.rms_norm_eps,
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        tie_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        make_vocab_size_divisible_by=make_vocab_size_divisible_by,
        init_std=getattr(c, "initializer_range", 0.02),
        **(moe.from_hf(c) if moe else {}),
    )


def _sliding_window(c) -> int | None:
    window = getattr(c, "sliding_window", None)
    if window is None:
        return None
    if getattr(c, "use_sliding_window", None) is False:
        return None
    layer_types = getattr(c, "layer_types", None)
    if layer_types is not None and "sliding_attention" not in layer_types:
        return None
    return int(window)


def hf_config_fields(m: ModelConfig) -> dict:
    """HF config keyword arguments describing `m` (any Llama-family config class takes them)."""
    fields = dict(
        vocab_size=m.vocab_size,
        hidden_size=m.hidden_size,
        intermediate_size=m.ffn_hidden_size,
        num_hidden_layers=m.num_layers,
        num_attention_heads=m.num_attention_heads,
        num_key_value_heads=m.kv_heads,
        head_dim=m.kv_channels,
        max_position_embeddings=m.max_position_embeddings,
        rms_norm_eps=m.norm_eps,
        tie_word_embeddings=m.tie_embeddings,
        hidden_act="silu",
        initializer_range=m.init_std,
        rope_theta=m.rope_theta,
    )
    if m.rope_scaling is not None:
        s = m.rope_scaling
        fields["rope_scaling"] = (
            {"rope_type": "linear", "factor": s.factor} if s.rope_type == "linear" else
            {"rope_type": "llama3", "factor": s.factor, "low_freq_factor": s.low_freq_factor,
             "high_freq_factor": s.high_freq_factor,
             "original_max_position_embeddings": s.original_max_position_embeddings})
    return fields


def llama_family_architecture(*, name: str, hf_prefix: str, config_class: str, qkv_bias: bool,
                              qk_norm: bool, hf_overrides: dict | None = None,
                              moe: MoEFormat | None = None) -> Architecture:
    """An Architecture for a Llama-family model whose HF classes are `<hf_prefix>For...`;
    `moe`: its experts' format, for a mixture-of-experts model."""
    import transformers

    def hf_config(m: ModelConfig) -> dict:
        cls = getattr(transformers, config_class)
        fields = {**hf_config_fields(m), **(moe.to_hf(m) if moe else {}), **(hf_overrides or {})}
        return cls(**fields).to_dict()

    def fits(m: ModelConfig) -> bool:
        same_moe = moe.fits(m) if moe else not m.is_moe
        return (m.qkv_bias == qkv_bias and m.qk_norm == qk_norm and same_moe
                and m.vision is None)

    return Architecture(
        name=name,
        causal_lm=f"{hf_prefix}ForCausalLM",
        sequence_classification=f"{hf_prefix}ForSequenceClassification",
        model_config=functools.partial(model_config_from_hf, qkv_bias=qkv_bias, qk_norm=qk_norm,
                                       moe=moe),
        hf_config=hf_config,
        rules=functools.partial(llama_family_rules, moe=moe),
        fits=fits,
    )
