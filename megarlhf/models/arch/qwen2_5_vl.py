"""Qwen2.5-VL: a Qwen2 language model with M-RoPE (3D positions) and a vision tower whose
features replace the image placeholder tokens' embeddings (models/gpt.py GPTVLModel).

The language model's tensors take Qwen2's rules. The vision tower's are carried as they are,
one whole (unsharded) tensor each under `vision.<name>` in our checkpoints, from HF's
`visual.<name>`; only the patch embedding's Conv3d weight (D, C, T, P, P) is stored flattened,
as the Linear (D, C*T*P*P) our tower runs. Names are the hub checkpoints' (`model.layers.*`,
`visual.*`), which transformers 5's save_pretrained writes too; its module names
(`model.language_model.*`, `model.visual.*`) are read as well, and exports use the hub names.
"""

from __future__ import annotations

import dataclasses

import torch

from megarlhf.models.arch.llama_family import (_rule, _same, llama_family_rules,
                                               model_config_from_hf)
from megarlhf.models.arch.registry import Architecture, TensorRule, register
from megarlhf.models.config import ModelConfig
from megarlhf.models.vision.qwen2_5_vl import Qwen25VisionTower, VisionConfig

PATCH_WEIGHT = "patch_embed.proj.weight"


def _model_config(c, *, make_vocab_size_divisible_by: int = 128) -> ModelConfig:
    text = c.text_config
    rope = dict(text.rope_parameters or {})
    if rope.get("rope_type", "default") != "default" or "mrope_section" not in rope:
        raise ValueError(f"{type(c).__name__}: text rope_parameters {rope} are not supported; "
                         f"only M-RoPE with mrope_section and rope_type 'default'")
    lm = model_config_from_hf(text, qkv_bias=True, qk_norm=False,
                              make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    # Qwen2.5-VL keeps tie_word_embeddings on the outer config, not the text config.
    return dataclasses.replace(lm, tie_embeddings=bool(c.tie_word_embeddings),
                               mrope_section=tuple(rope["mrope_section"]),
                               vision=VisionConfig.from_hf(c.vision_config),
                               image_token_id=c.image_token_id)


def _hf_config(m: ModelConfig) -> dict:
    """Refused: the vision start/end and video token ids and tokens_per_second live only in
    the source's config.json, which the checkpoint's hf/ sidecar keeps; rebuilt from the model
    config they would be transformers' defaults, not the model's."""
    raise ValueError("a Qwen2.5-VL checkpoint exports with the config.json of its hf/ sidecar "
                     "(hf_to_mcore writes it): copy the source model's config.json into "
                     "CHECKPOINT/hf")


def _vision_rules(v: VisionConfig) -> list[TensorRule]:
    """One rule per tensor of the tower; the tower itself (on the meta device) lists them."""
    with torch.device("meta"):
        shapes = {name: tuple(t.shape) for name, t in Qwen25VisionTower(v).state_dict().items()}
    conv = (v.hidden_size, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
    flatten = (lambda tensors: [tensors[0].reshape(conv[0], -1)],
               lambda t: [t.reshape(conv).contiguous()])
    return [_rule("vision." + name, ["visual." + name], [conv if name == PATCH_WEIGHT else shape],
                  flatten if name == PATCH_WEIGHT else _same())
            for name, shape in shapes.items()]


def _rules(m: ModelConfig, *, lm_head: bool, value_head: bool) -> list[TensorRule]:
    return llama_family_rules(m, lm_head=lm_head, value_head=value_head) + _vision_rules(m.vision)


def _fits(m: ModelConfig) -> bool:
    return m.vision is not None and m.qkv_bias and not m.qk_norm and not m.is_moe


QWEN2_5_VL = register(Architecture(
    name="qwen2_5_vl",
    causal_lm="Qwen2_5_VLForConditionalGeneration",
    sequence_classification=None,
    model_config=_model_config,
    hf_config=_hf_config,
    rules=_rules,
    fits=_fits,
    hf_aliases=(("model.language_model.", "model."), ("model.visual.", "visual.")),
))
