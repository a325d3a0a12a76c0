"""HF PEFT's LoRA directory format: file names, tensor names, and the settings a directory
declares (read in the launching process for lora.from_peft, before any rank starts).

A PEFT LoRA adapter directory holds `adapter_config.json` (r, lora_alpha, use_rslora,
target_modules, ...) and `adapter_model.safetensors` with, per adapted module,
`base_model.model.<module>.lora_A.weight` [r, in] and `...lora_B.weight` [out, r]. The module
of projection p in layer i is `model.layers.<i>.self_attn.<p>` (attention) or
`model.layers.<i>.mlp.<p>` in every architecture megarlhf converts.
"""

from __future__ import annotations

import json
import os

from safetensors import safe_open

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
TARGETS = ATTENTION_TARGETS + MLP_TARGETS
"""The HF projections of a transformer layer, which adapters target by name."""

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_UNSUPPORTED = {  # adapter_config.json fields whose non-default values we cannot honour
    "use_dora": False, "fan_in_fan_out": False, "bias": "none", "lora_bias": False,
    "modules_to_save": None, "layers_to_transform": None, "rank_pattern": {},
    "alpha_pattern": {}}


def peft_module(layer: int, projection: str) -> str:
    """The HF module name of `projection` in layer `layer` (0-based)."""
    block = "self_attn" if projection in ATTENTION_TARGETS else "mlp"
    return f"model.layers.{layer}.{block}.{projection}"


def adapter_key(layer: int, projection: str, factor: str) -> str:
    """The safetensors name of factor 'A' or 'B' of `projection`'s adapter in `layer`."""
    return f"{_PREFIX}{peft_module(layer, projection)}.lora_{factor}.weight"


def adapter_settings(directory: str) -> dict:
    """The LoraConfig fields (rank, alpha, use_rslora, dropout, target_modules) of the PEFT
    adapter at
    `directory`; ValueError (one line) for what is not a LoRA adapter we can load."""
    path = os.path.join(directory, CONFIG_FILE)
    if not os.path.isfile(path) or not os.path.isfile(os.path.join(directory, WEIGHTS_FILE)):
        raise ValueError(f"lora.from_peft: {directory} is not a PEFT adapter directory (needs "
                         f"{CONFIG_FILE} and {WEIGHTS_FILE})")
    with open(path) as f:
        config = json.load(f)
    if config.get("peft_type") != "LORA":
        raise ValueError(f"lora.from_peft: {path} has peft_type {config.get('peft_type')!r}; "
                         f"only LORA adapters load")
    odd = {k: config[k] for k, default in _UNSUPPORTED.items()
           if config.get(k, default) not in (default, None, {}, False)}
    if config.get("init_lora_weights", True) not in (True, False, "gaussian"):
        # PiSSA, OLoRA, LoftQ, CorDA ... save their adapter against a changed base.
        odd["init_lora_weights"] = config["init_lora_weights"]
    if odd:
        raise ValueError(f"lora.from_peft: {path} uses {odd}, which megarlhf's adapters do "
                         f"not have (one rank and scale per module, no bias, no DoRA)")
    with safe_open(os.path.join(directory, WEIGHTS_FILE), "pt") as f:
        names = list(f.keys())
    projections = sorted({name.split(".lora_")[0].rsplit(".", 1)[-1] for name in names})
    unknown = [p for p in projections if p not in TARGETS]
    if unknown or not projections:
        raise ValueError(f"lora.from_peft: {directory} adapts {unknown or 'nothing'}; the "
                         f"projections megarlhf adapts are {TARGETS}")
    return {"rank": int(config["r"]), "alpha": float(config["lora_alpha"]),
            "use_rslora": bool(config.get("use_rslora", False)),
            "dropout": float(config.get("lora_dropout") or 0.0),
            "target_modules": tuple(p for p in TARGETS if p in projections)}
