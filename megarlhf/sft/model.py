"""The engine a stage trains: an LM (SFT) or a value model (RM), from a preset or a checkpoint.

A reward model usually starts from the SFT model. An LM checkpoint has no value head and an
output layer the value model lacks, so it is loaded trunk-only: every tensor but the head comes
from the checkpoint, and the head keeps its seeded initialisation.
"""

from __future__ import annotations

import os

from megarlhf.compat.megatron import load_dist_checkpoint
from megarlhf.engine.checkpoint import HF_SIDECAR, load_checkpoint, read_meta
from megarlhf.engine.optim import OptimConfig
from megarlhf.engine.train import TrainEngine
from megarlhf.models.config import ModelConfig
from megarlhf.models.gpt import model_spec
from megarlhf.convert.peft_adapter import check_adapter, load_adapter
from megarlhf.models.lora import check_model as check_lora_targets, is_adapter_key
from megarlhf.models.transformer_config import parse_dtype
from megarlhf.parallel.mesh import Mesh, ParallelConfig
from megarlhf.sft.config import ModelSource

HEAD_PREFIX = "value_head."


def model_config(source: ModelSource, *, value_head: bool) -> ModelConfig:
    """The architecture to build; ValueError if the checkpoint (or the LoRA adapters) cannot
    start this stage."""
    model = _model_config(source, value_head=value_head)
    if source.lora is not None:
        check_lora_targets(source.lora, is_moe=model.is_moe)
        if source.lora.from_peft is not None:
            check_adapter(source.lora.from_peft, model, source.lora)
    return model


def _model_config(source: ModelSource, *, value_head: bool) -> ModelConfig:
    if source.preset is not None:
        return source.preset_config()
    meta = read_meta(source.checkpoint)
    if meta.get("lora"):
        raise ValueError(f"model.checkpoint {source.checkpoint} holds LoRA adapters; a stage "
                         f"starts from full weights: export it merged (python -m "
                         f"tools.convert_hf.mcore_to_hf --ckpt {source.checkpoint} --out DIR) "
                         f"and convert that back with tools.convert_hf.hf_to_mcore")
    if meta["value_head"] and not value_head:
        raise ValueError(f"{source.checkpoint} holds a value model (critic or reward); SFT "
                         f"trains a language model, so start it from an LM checkpoint")
    return ModelConfig.from_dict(meta["model"])


def new_engine(source: ModelSource, model: ModelConfig, parallel: ParallelConfig, mesh: Mesh,
               optim: OptimConfig, *, value_head: bool) -> TrainEngine:
    """A trainable engine for `model`; its weights are the preset's seeded initialisation
    until `init_weights` (or a resume) loads others."""
    spec = model_spec(model, parallel, value_head=value_head, dtype=parse_dtype(source.dtype),
                      layer_spec=source.layer_spec, lora=source.lora)
    return TrainEngine(spec, mesh, optim)


def init_weights(source: ModelSource, engine: TrainEngine) -> str:
    """Load the starting weights `source` names (and a PEFT adapter it starts from); returns
    a line saying where they came from."""
    line = _init_base(source, engine)
    if source.lora is not None and source.lora.from_peft is not None:
        load_adapter(source.lora.from_peft, engine.unwrapped())
        line += f", LoRA adapter from {source.lora.from_peft}"
        engine.refresh_masters()
    return line


def _init_base(source: ModelSource, engine: TrainEngine) -> str:
    if source.checkpoint is None:
        return f"fresh weights from preset {source.preset!r}"
    meta = read_meta(source.checkpoint)
    value_head = engine.spec.value_head
    if meta["value_head"] == value_head:
        load_checkpoint(source.checkpoint, engine, with_optimizer=False)
        return f"weights from {source.checkpoint}"
    assert value_head, "model_config refuses value checkpoints for LM stages"
    load_trunk(source.checkpoint, engine, meta)
    engine.refresh_masters()
    return f"trunk from LM {source.checkpoint}, new value head"


def load_trunk(path: str, engine: TrainEngine, meta: dict) -> None:
    """Load every tensor of a value model except its head from the LM checkpoint at `path`."""
    for chunk in engine.unwrapped():
        template = {k: v for k, v in chunk.sharded_state_dict().items()
                    if not k.startswith(HEAD_PREFIX) and not is_adapter_key(k)}
        # The template holds only trunk tensors, so the checkpoint's output layer is not read;
        # the load also returns the checkpoint's non-tensor state (optimizer, schedule), which
        # is not ours to take.
        loaded = load_dist_checkpoint(template, path)
        result = chunk.load_state_dict({k: loaded[k] for k in template}, strict=False)
        missing = [k for k in result.missing_keys
                   if not k.startswith(HEAD_PREFIX) and not is_adapter_key(k)]
        assert not missing and not result.unexpected_keys, (missing, result.unexpected_keys)
    engine.provenance = {"architecture": meta.get("architecture"),
                         "hf_files": _sidecar_files(os.path.join(path, HF_SIDECAR))}


def _sidecar_files(directory: str) -> dict[str, bytes]:
    if not os.path.isdir(directory):
        return {}
    out = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            out[name] = f.read()
    return out
