"""The architecture registry: which HF model classes we map, and how.

An `Architecture` says how an HF config becomes our `ModelConfig` (and back), and which
`TensorRule`s move weights between HF names and Megatron checkpoint keys. The converters and the
rollout resharding bridge both go through these rules, so the mapping exists once.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from megarlhf.models.config import ModelConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class TensorRule:
    """One Megatron tensor and the HF tensors it is made of.

    `mcore` is the layout-free checkpoint key (layers, and a mixture-of-experts layer's
    experts, stacked on leading axes); in `hf` names, `{i}` stands for the layer index and
    `{e}` for the expert's. `rows` gives the Megatron tensor of one layer as
    row blocks of the HF tensors (in `hf` order): views whose concatenation along dim 0 is the
    tensor, so a writer can write them one after another without fusing them; `fuse`
    concatenates them and `split` is its exact inverse. A `vocab` tensor has one row per
    token: Megatron pads its rows for TP, HF has exactly `vocab_size`.
    """

    mcore: str
    hf: tuple[str, ...]
    rows: Callable[[list[torch.Tensor]], list[torch.Tensor]]
    split: Callable[[torch.Tensor], list[torch.Tensor]]
    hf_shapes: tuple[tuple[int, ...], ...]
    vocab: bool = False

    def fuse(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        blocks = self.rows(tensors)
        return blocks[0].contiguous() if len(blocks) == 1 else torch.cat(blocks)

    @property
    def stacked_axes(self) -> int:
        """Leading axes of the checkpoint key: 0 (one tensor), 1 (per layer: `{i}` in the HF
        names), 2 (per layer and expert: `{i}` and `{e}`)."""
        return ("{i}" in self.hf[0]) + ("{e}" in self.hf[0])

    @property
    def per_layer(self) -> bool:
        return self.stacked_axes > 0

    def indices(self, model: ModelConfig) -> list[tuple[int, ...]]:
        """Every (layer[, expert]) index of this key, layer-major; [()] for one tensor."""
        if self.stacked_axes == 2:
            return [(i, e) for i in range(model.num_layers) for e in range(model.num_experts)]
        return [(i,) for i in range(model.num_layers)] if self.per_layer else [()]

    def hf_names(self, index: tuple[int, ...]) -> list[str]:
        """The HF names at a (layer[, expert]) index (() for a whole tensor)."""
        fields = dict(zip("ie", index))
        return [name.format(**fields) for name in self.hf]


def layer_major(rules: list[TensorRule], model: ModelConfig
                ) -> list[tuple[TensorRule, tuple[int, ...]]]:
    """(rule, index) of every stacked tensor, layer by layer (within a layer in rule order, an
    MoE rule's experts one after another): the order streams write a model in."""
    per_layer: list[list] = [[] for _ in range(model.num_layers)]
    for rule in rules:
        for index in rule.indices(model) if rule.per_layer else []:
            per_layer[index[0]].append((rule, index))
    return [unit for units in per_layer for unit in units]


def hf_shapes(rules: list[TensorRule], model: ModelConfig) -> dict[str, tuple[int, ...]]:
    """{HF name: shape} of every tensor the rules describe."""
    return {name: shape for rule in rules for index in rule.indices(model)
            for name, shape in zip(rule.hf_names(index), rule.hf_shapes)}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Architecture:
    name: str
    """Our short name, stored in checkpoints ('llama', 'qwen2', ...)."""
    causal_lm: str
    """HF class of the LM (actor / reference)."""
    sequence_classification: str | None
    """HF class of the scalar-head model (critic / reward); None: no value-model form."""
    model_config: Callable[..., ModelConfig]
    """(HF PretrainedConfig, make_vocab_size_divisible_by=...) -> ModelConfig; raises
    ValueError for features we cannot reproduce exactly."""
    hf_config: Callable[[ModelConfig], dict]
    """ModelConfig -> HF config fields, for checkpoints that did not come from HF."""
    rules: Callable[..., list[TensorRule]]
    """(ModelConfig, lm_head=..., value_head=...) -> the tensors of a model."""
    fits: Callable[[ModelConfig], bool]
    """Whether a model built without an HF origin (our presets, SFT from scratch) has this
    architecture's features, so that exporting it as this architecture is exact."""
    hf_aliases: tuple[tuple[str, str], ...] = ()
    """(prefix, prefix of the rules' names) pairs: other spellings of tensor names that HF
    checkpoints of this architecture use, read as the rules' names (exports use the rules')."""

    def hf_class(self, value_head: bool) -> str:
        return self.sequence_classification if value_head else self.causal_lm


_BY_HF_CLASS: dict[str, Architecture] = {}
_BY_NAME: dict[str, Architecture] = {}


def register(arch: Architecture) -> Architecture:
    for cls in filter(None, (arch.causal_lm, arch.sequence_classification)):
        if cls in _BY_HF_CLASS:
            raise ValueError(f"HF class {cls} is registered twice")
        _BY_HF_CLASS[cls] = arch
    _BY_NAME[arch.name] = arch
    return arch


def supported_hf_classes() -> list[str]:
    return sorted(_BY_HF_CLASS)


def architecture_for_hf_class(hf_class: str) -> tuple[Architecture, bool]:
    """(architecture, is_sequence_classification) for an HF `architectures` entry."""
    if hf_class not in _BY_HF_CLASS:
        raise ValueError(
            f"unsupported architecture {hf_class!r}; supported: {', '.join(supported_hf_classes())}"
        )
    arch = _BY_HF_CLASS[hf_class]
    return arch, hf_class == arch.sequence_classification


def architecture_for_hf_config(config, where: str) -> tuple[Architecture, bool]:
    """(architecture, is_sequence_classification) of a loaded HF config; `where` names the
    directory in errors."""
    classes = getattr(config, "architectures", None) or []
    if len(classes) != 1:
        raise ValueError(f"{where}/config.json must name exactly one class in 'architectures', "
                         f"got {classes}")
    return architecture_for_hf_class(classes[0])


def architecture_names() -> list[str]:
    return sorted(_BY_NAME)


def architecture(name: str) -> Architecture:
    if name not in _BY_NAME:
        raise ValueError(f"unknown architecture {name!r}; known: {sorted(_BY_NAME)}")
    return _BY_NAME[name]


def architecture_for_model(model: ModelConfig, name: str | None = None) -> Architecture:
    """The architecture `name` (a checkpoint's record of where it came from), else the first
    registered that `fits` the model: for models that never were HF ones. Look-alikes are
    registered after the family's base (Llama before Mistral), so the base is chosen."""
    if name:
        return architecture(name)
    for arch in _BY_NAME.values():
        if arch.fits(model):
            return arch
    raise ValueError(f"no registered architecture has this model's features; known: "
                     f"{sorted(_BY_NAME)}")
