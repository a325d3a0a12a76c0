"""Megatron dist checkpoint (any layout) -> HF safetensors directory, one layer at a time."""

from __future__ import annotations

import json
import os
from typing import Iterator

import torch

from megarlhf.convert.outputs import (copy_sidecar, finish_output, prepare_output,
                                      removed_on_error)
from megarlhf.convert.mcore_io import CheckpointReader, LayeredReader
from megarlhf.convert.safetensors_io import ShardWriter
from megarlhf.engine.checkpoint import (HF_SIDECAR, base_checkpoint, checkpoint_architecture,
                                       read_meta, replace_dir)
from megarlhf.models.arch import Architecture, architecture, layer_major
from megarlhf.models.config import ModelConfig
from megarlhf.convert.peft_adapter import write_adapter
from megarlhf.models.lora import LoraConfig, adapter_keys, is_adapter_key, merged
from megarlhf.models.transformer_config import parse_dtype

DEFAULT_SHARD_BYTES = 2 * 1024**3


LORA_EXPORTS = ("merged", "adapter")


def mcore_to_hf(ckpt: str, out: str, *, dtype: str | None = None, force: bool = False,
                arch_name: str | None = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                lora: str = "merged", base: str | None = None) -> str:
    """Export; returns the output directory. `dtype` defaults to the checkpoint's own. A
    checkpoint with LoRA adapters exports as a model with them merged (`lora='merged'`) or
    as a PEFT adapter directory over its base (`lora='adapter'`). `base`: where the base of
    an adapter-only checkpoint is now, if it moved from the path the checkpoint records."""
    meta = read_meta(ckpt)
    model = ModelConfig.from_dict(meta["model"])
    value_head = meta["value_head"]
    if lora not in LORA_EXPORTS:
        raise ValueError(f"--lora {lora!r} is not one of {LORA_EXPORTS}")
    if lora == "adapter":
        return _export_adapter(ckpt, out, meta, force=force, dtype=dtype)
    arch = architecture(arch_name) if arch_name else checkpoint_architecture(meta)
    out_dtype = parse_dtype(dtype or meta["dtype"])
    reader = checkpoint_reader(ckpt, meta, base, field="--base")
    rules = arch.rules(model, lm_head=not value_head, value_head=value_head)
    for rule in rules:
        if reader.shape(rule.mcore) is None:
            raise ValueError(f"{ckpt} has no tensor {rule.mcore!r}, which a {arch.name} "
                             f"{'value model' if value_head else 'LM'} needs; if the checkpoint "
                             f"is of another architecture, name it with --arch")
    tmp = prepare_output(out, force, inputs=reader.sources)
    with removed_on_error(tmp):
        with reader.background_checks():  # every CRC32 checked before the output is renamed in
            _export_weights(ckpt, reader, rules, model, tmp, max_shard_bytes, out_dtype,
                            merge=_adapter_merge(reader, meta.get("lora")))
        sidecar = os.path.join(ckpt, HF_SIDECAR)
        if os.path.isdir(sidecar):
            copy_sidecar(sidecar, tmp)
        _write_config(tmp, arch, model, value_head, out_dtype)
        finish_output(tmp, {"tool": "mcore_to_hf", "source": os.path.abspath(ckpt)})
    final = os.path.abspath(out)
    replace_dir(tmp, final)
    return final


def _export_adapter(ckpt: str, out: str, meta: dict, *, force: bool,
                    dtype: str | None) -> str:
    """The checkpoint's adapters as a PEFT LoRA directory (the base is the model it was
    trained from, exported on its own)."""
    if not meta.get("lora"):
        raise ValueError(f"--lora adapter: {ckpt} holds no LoRA adapters; export the model "
                         f"itself (--lora merged)")
    if meta["value_head"]:
        raise ValueError(f"--lora adapter: {ckpt} is a value model, whose head PEFT's "
                         f"CAUSAL_LM adapter cannot hold; export it merged")
    config = LoraConfig(**meta["lora"])
    out_dtype = parse_dtype(dtype or meta["dtype"])
    model = ModelConfig.from_dict(meta["model"])
    reader = CheckpointReader(ckpt)
    # (factor, projection) -> its stacked key, 'decoder.layers.<block>.<linear>.lora_A.q_proj'
    stored = {tuple(key.rsplit(".", 2)[1:]): key for key in reader.metadata.state_dict_metadata
              if key.startswith("decoder.layers.") and is_adapter_key(key)}

    def read(layer: int, projection: str, factor: str) -> torch.Tensor:
        return _read_at(reader, stored[f"lora_{factor}", projection], (layer,)).to(out_dtype)

    tmp = prepare_output(out, force, inputs=[ckpt])
    with removed_on_error(tmp):
        with reader.background_checks():
            write_adapter(tmp, config, model.num_layers, read)
        finish_output(tmp, {"tool": "mcore_to_hf --lora adapter",
                            "source": os.path.abspath(ckpt)})
    final = os.path.abspath(out)
    replace_dir(tmp, final)
    return final


def checkpoint_reader(ckpt: str, meta: dict, base: str | None = None, *,
                      field: str | None = None) -> CheckpointReader | LayeredReader:
    """A reader of every tensor of the checkpoint `ckpt` (completion marker `meta`): an
    adapter-only checkpoint's over its base's (engine.checkpoint.base_checkpoint: `base`
    where it moved, named by `field`)."""
    reader = CheckpointReader(ckpt)
    if not meta.get("base"):
        return reader
    return LayeredReader(reader, CheckpointReader(base_checkpoint(ckpt, meta, base,
                                                                  field=field)))


def _adapter_merge(reader: CheckpointReader, lora: dict | None):
    """For a checkpoint with LoRA adapters: (rule, layer index, HF name, weight) -> the weight
    with its projection's adapter merged in, W + scale * B @ A (in fp32), one projection at
    a time; None without adapters."""
    if lora is None:
        return None
    config = LoraConfig(**lora)

    def merge(rule, index, name: str, weight: torch.Tensor) -> torch.Tensor:
        keys = adapter_keys(rule.mcore, name, config)
        if keys is None:
            return weight
        a, b = (_read_at(reader, key, index) for key in keys)
        return merged(weight, a, b, config, dtype=torch.float32)  # cast once, on write

    return merge


def _read_at(reader: CheckpointReader, key: str, index: tuple[int, ...]) -> torch.Tensor:
    """The tensor `key` at leading index `index` (a layer's slab of a stacked tensor)."""
    shape, n = reader.shape(key), len(index)
    if shape is None:
        raise ValueError(f"{reader.path} has no tensor {key!r}")
    slab = (key, index + (0,) * (len(shape) - n), (1,) * n + shape[n:])
    return reader.read([slab])[0].reshape(shape[n:])


def _export_weights(ckpt, reader: CheckpointReader, rules, model: ModelConfig, directory: str,
                    max_shard_bytes: int, dtype: torch.dtype, merge=None) -> None:
    """Every HF tensor (_hf_tensors) written out as it is read."""
    order = _order(rules, model)
    entries = [(name, dtype, shape) for rule, index in order
               for name, shape in zip(rule.hf_names(index), rule.hf_shapes)]
    with ShardWriter(directory, max_shard_bytes, entries) as writer:
        for name, tensor in _hf_tensors(ckpt, reader, order, model, merge):
            writer.add(name, tensor.to(dtype))


def checkpoint_hf_tensors(ckpt: str) -> Iterator[tuple[str, torch.Tensor]]:
    """A language-model checkpoint's tensors under their HF names (LoRA adapters merged, an
    adapter-only checkpoint's over its base), one at a time in the export's order, each CRC32
    checked before the last is given: what a generative judge's Megatron engine loads from a
    checkpoint without an export."""
    meta = read_meta(ckpt)
    model = ModelConfig.from_dict(meta["model"])
    rules = checkpoint_architecture(meta).rules(model, lm_head=True, value_head=False)
    reader = checkpoint_reader(ckpt, meta)
    with reader.background_checks():
        yield from _hf_tensors(ckpt, reader, _order(rules, model), model,
                               _adapter_merge(reader, meta.get("lora")))


def _order(rules, model: ModelConfig) -> list:
    """Whole tensors, then each layer's (an MoE layer's one expert at a time)."""
    return [(r, ()) for r in rules if not r.per_layer] + layer_major(rules, model)


def _hf_tensors(ckpt, reader: CheckpointReader, order, model: ModelConfig, merge=None
                ) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF tensors of `order`'s rules, each read, split and checked against the model's
    shapes as it is needed: memory holds one rule's at a time. With `merge`
    (_adapter_merge), each adapted projection merged."""
    for rule, index in order:
        fused = _read_at(reader, rule.mcore, index)
        for name, tensor, shape in zip(rule.hf_names(index), rule.split(fused), rule.hf_shapes):
            if merge is not None:
                tensor = merge(rule, index, name, tensor)
            if rule.vocab:
                tensor = tensor[: model.vocab_size]
            if tuple(tensor.shape) != shape:
                raise ValueError(f"{ckpt}: {rule.mcore} gives {name} of shape "
                                 f"{tuple(tensor.shape)}, the model config implies {shape}")
            yield name, tensor


def _write_config(directory: str, arch: Architecture, model: ModelConfig, value_head: bool,
                  dtype: torch.dtype) -> None:
    """Keep the source's config.json as it was (every field, RoPE scaling included); without
    one, describe `model`. Only the class (a critic grown from an LM) and dtype may change, and
    the file is rewritten only if one of them does."""
    path = os.path.join(directory, "config.json")
    if os.path.isfile(path):
        with open(path) as f:
            config = json.load(f)
    else:
        config = arch.hf_config(model)
    original = json.dumps(config, sort_keys=True)
    hf_class = arch.hf_class(value_head)
    if config.get("architectures") != [hf_class]:
        config["architectures"] = [hf_class]
        if value_head:
            config["id2label"], config["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
    dtype_keys = [k for k in ("dtype", "torch_dtype") if config.get(k)] or ["dtype"]
    for key in dtype_keys:
        config[key] = str(dtype).removeprefix("torch.")
    if os.path.isfile(path) and json.dumps(config, sort_keys=True) == original:
        return
    with open(path, "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
