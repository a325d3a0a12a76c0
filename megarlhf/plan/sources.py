"""The architecture behind a role's model path, read without loading any weight.

A path is one of:
- a megarlhf (Megatron) checkpoint directory: its completion marker records the ModelConfig
  and whether it has a value head;
- an HF model directory: its config.json, through the converter's architecture registry (the
  same mapping `tools/convert_hf` applies, so the plan describes the converted model);
- `preset:NAME`: a named shape from megarlhf.models.presets, for planning before anything
  is downloaded or converted.
"""

from __future__ import annotations

import dataclasses
import os

from megarlhf.engine.checkpoint import is_complete, read_meta
from megarlhf.models.config import ModelConfig
from megarlhf.models.presets import preset

PRESET_PREFIX = "preset:"


@dataclasses.dataclass(frozen=True)
class ModelSource:
    model: ModelConfig
    value_head: bool
    origin: str
    """Where the shape came from, for the report ('checkpoint', 'HF config', 'preset')."""


def resolve(path: str, *, field: str, value_head: bool) -> ModelSource:
    """The shape of the model at `path` (the recipe's `field`); `value_head` is what its role
    needs (critic and reward: True). A checkpoint that disagrees is refused."""
    if path.startswith(PRESET_PREFIX):
        return ModelSource(preset(path[len(PRESET_PREFIX):]), value_head, "preset")
    if is_complete(path):
        meta = read_meta(path)
        if meta["value_head"] != value_head:
            kind = "a value head" if meta["value_head"] else "an LM head"
            raise ValueError(f"{field}: checkpoint {path} has {kind}, the role needs "
                             f"{'a value head' if value_head else 'an LM head'}")
        return ModelSource(ModelConfig.from_dict(meta["model"]), value_head, "checkpoint")
    if os.path.isfile(os.path.join(path, "config.json")):
        return ModelSource(_from_hf(path), value_head, "HF config")
    hint = ("it does not exist yet" if not os.path.exists(path)
            else "it is neither a megarlhf checkpoint nor an HF model directory")
    raise ValueError(f"{field}: cannot read the model shape from {path!r}: {hint}. Convert "
                     f"it first (tools/convert_hf), or plan with {field}=preset:NAME (presets: "
                     f"megarlhf.models.presets)")


def _from_hf(path: str) -> ModelConfig:
    import transformers

    from megarlhf.models.arch import architecture_for_hf_config

    config = transformers.AutoConfig.from_pretrained(path)
    arch, _ = architecture_for_hf_config(config, path)
    return arch.model_config(config)
