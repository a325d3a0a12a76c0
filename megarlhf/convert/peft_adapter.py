"""LoRA adapters in HF PEFT's directory format, both ways.

A PEFT LoRA adapter directory holds `adapter_config.json` (r, lora_alpha, use_rslora,
target_modules, ...) and `adapter_model.safetensors` with, per adapted module,
`base_model.model.<module>.lora_A.weight` [r, in] and `...lora_B.weight` [out, r]. Our
adapters are per HF projection (models/lora.py), so each maps one to one; the module of
projection p in layer i is `model.layers.<i>.self_attn.<p>` (attention) or
`model.layers.<i>.mlp.<p>` in every architecture megarlhf converts.

- `write_adapter`: a checkpoint's adapters -> a PEFT directory (mcore_to_hf --lora adapter);
- `adapter_settings` / `check_adapter`: read and check a PEFT directory in the launching
  process (lora.from_peft): LoRA only, one rank and scale for every module, shapes of this
  base;
- `load_adapter`: on every rank, copy this rank's slices into the model's adapters.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megarlhf.models.config import ModelConfig
from megarlhf.models.lora import ATTENTION_TARGETS, TARGETS, LoraConfig, lora_layers

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


def _key(layer: int, projection: str, factor: str) -> str:
    return f"{_PREFIX}{peft_module(layer, projection)}.lora_{factor}.weight"


def adapter_settings(directory: str) -> dict:
    """The LoraConfig fields (rank, alpha, use_rslora, target_modules) of the PEFT adapter at
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
            "target_modules": tuple(p for p in TARGETS if p in projections)}


def check_adapter(directory: str, model: ModelConfig, lora: LoraConfig) -> None:
    """Every layer has every targeted projection's A and B, of this base's shapes."""
    h, d = model.hidden_size, model.kv_channels
    out = {"q_proj": model.num_attention_heads * d, "k_proj": model.kv_heads * d,
           "v_proj": model.kv_heads * d, "o_proj": h, "gate_proj": model.ffn_hidden_size,
           "up_proj": model.ffn_hidden_size, "down_proj": h}
    inp = {**{p: h for p in out}, "o_proj": model.num_attention_heads * d,
           "down_proj": model.ffn_hidden_size}
    with safe_open(os.path.join(directory, WEIGHTS_FILE), "pt") as f:
        names = set(f.keys())
        for layer in range(model.num_layers):
            for p in lora.targets:
                for factor, shape in (("A", (lora.rank, inp[p])), ("B", (out[p], lora.rank))):
                    key = _key(layer, p, factor)
                    if key not in names:
                        raise ValueError(f"lora.from_peft: {directory} has no {key}; the "
                                         f"adapter must cover every layer of the model")
                    got = tuple(f.get_slice(key).get_shape())
                    if got != shape:
                        raise ValueError(f"lora.from_peft: {key} is {got}, this base needs "
                                         f"{shape}: the adapter was trained on another model")


@torch.no_grad()
def load_adapter(directory: str, chunks: list[torch.nn.Module]) -> None:
    """Copy the adapter into this rank's model chunks: the whole factor where the adapter is
    replicated, this rank's rows of B (column parallel) or columns of A (row parallel)."""
    with safe_open(os.path.join(directory, WEIGHTS_FILE), "pt") as f:
        for layer_number, linear in lora_layers(chunks):
            for p in linear.lora_A:
                a = f.get_tensor(_key(layer_number - 1, p, "A"))
                b = f.get_tensor(_key(layer_number - 1, p, "B"))
                if linear.lora_a_split:
                    a = a.chunk(linear.tp_size, dim=1)[linear.tp_rank]
                else:
                    b = b.chunk(linear.tp_size, dim=0)[linear.tp_rank]
                linear.lora_A[p].copy_(a)
                linear.lora_B[p].copy_(b)


def write_adapter(directory: str, lora: LoraConfig, num_layers: int, read) -> None:
    """Write a PEFT adapter directory: `read(layer, projection, factor)` gives the full
    factor of one layer."""
    tensors = {_key(i, p, f): read(i, p, f).contiguous()
               for i in range(num_layers) for p in lora.targets for f in "AB"}
    save_file(tensors, os.path.join(directory, WEIGHTS_FILE), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank,
              "lora_alpha": lora.alpha, "use_rslora": lora.use_rslora,
              "target_modules": list(lora.targets), "lora_dropout": 0.0, "bias": "none",
              "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True}
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
