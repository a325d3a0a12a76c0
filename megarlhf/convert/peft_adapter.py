"""LoRA adapters in HF PEFT's directory format (models/peft_format.py), both ways. Our
adapters are per HF projection (models/lora.py), so each maps onto PEFT's one to one.

- `write_adapter`: a checkpoint's adapters -> a PEFT directory (mcore_to_hf --lora adapter);
- `check_adapter`: check a PEFT directory against the base in the launching process
  (lora.from_peft; models/peft_format reads its settings): shapes of this base;
- `load_adapter`: on every rank, copy this rank's slices into the model's adapters.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megarlhf.models.config import ModelConfig
from megarlhf.models.lora import LoraConfig, lora_layers, projection_shapes
from megarlhf.models.peft_format import CONFIG_FILE, WEIGHTS_FILE, adapter_key


def check_adapter(directory: str, model: ModelConfig, lora: LoraConfig) -> None:
    """Every layer has every targeted projection's A and B, of this base's shapes."""
    shapes = projection_shapes(model)
    with safe_open(os.path.join(directory, WEIGHTS_FILE), "pt") as f:
        names = set(f.keys())
        for layer in range(model.num_layers):
            for p in lora.targets:
                inp, out = shapes[p]
                for factor, shape in (("A", (lora.rank, inp)), ("B", (out, lora.rank))):
                    key = adapter_key(layer, p, factor)
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
                a = f.get_tensor(adapter_key(layer_number - 1, p, "A"))
                b = f.get_tensor(adapter_key(layer_number - 1, p, "B"))
                if linear.lora_a_split:
                    a = a.chunk(linear.tp_size, dim=1)[linear.tp_rank]
                else:
                    b = b.chunk(linear.tp_size, dim=0)[linear.tp_rank]
                linear.lora_A[p].copy_(a)
                linear.lora_B[p].copy_(b)


def write_adapter(directory: str, lora: LoraConfig, num_layers: int, read) -> None:
    """Write a PEFT adapter directory: `read(layer, projection, factor)` gives the full
    factor of one layer."""
    tensors = {adapter_key(i, p, f): read(i, p, f).contiguous()
               for i in range(num_layers) for p in lora.targets for f in "AB"}
    save_file(tensors, os.path.join(directory, WEIGHTS_FILE), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": lora.rank,
              "lora_alpha": lora.alpha, "use_rslora": lora.use_rslora,
              "target_modules": list(lora.targets), "lora_dropout": lora.dropout, "bias": "none",
              "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True}
    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
