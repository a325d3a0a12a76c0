"""The engine a stage trains: an LM (SFT) or a value model (RM), from a preset or a checkpoint.

A reward model usually starts from the SFT model. An LM checkpoint has no value head and an
output layer the value model lacks, so it is loaded trunk-only: every tensor but the head comes
from the checkpoint, and the head keeps its seeded initialisation.
"""

from __future__ import annotations

from megarlhf.engine.checkpoint import load_base, read_meta
from megarlhf.engine.optim import OptimConfig
from megarlhf.engine.train import TrainEngine
from megarlhf.models.config import ModelConfig
from megarlhf.models.gpt import model_spec
from megarlhf.convert.peft_adapter import check_adapter, load_adapter
from megarlhf.models.lora import check_model as check_lora_targets
from megarlhf.models.transformer_config import parse_dtype
from megarlhf.models.vision import refuse_in_stages
from megarlhf.parallel.mesh import Mesh, ParallelConfig
from megarlhf.sft.config import ModelSource


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
        model = source.preset_config()
        refuse_in_stages(model, f"model.preset {source.preset} with its overrides")
        return model
    meta = read_meta(source.checkpoint)
    if meta.get("lora"):
        raise ValueError(f"model.checkpoint {source.checkpoint} holds LoRA adapters; a stage "
                         f"starts from full weights: export it merged (python -m "
                         f"tools.convert_hf.mcore_to_hf --ckpt {source.checkpoint} --out DIR) "
                         f"and convert that back with tools.convert_hf.hf_to_mcore")
    if meta["value_head"] and not value_head:
        raise ValueError(f"{source.checkpoint} holds a value model (critic or reward); SFT "
                         f"trains a language model, so start it from an LM checkpoint")
    model = ModelConfig.from_dict(meta["model"])
    refuse_in_stages(model, f"model.checkpoint {source.checkpoint}")
    return model


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
    load_base(source.checkpoint, engine)
    if read_meta(source.checkpoint)["value_head"] == engine.spec.value_head:
        return f"weights from {source.checkpoint}"
    return f"trunk from LM {source.checkpoint}, new value head"
