"""Save and load model (+ optimizer + LR schedule) state with megatron-core dist_checkpointing.

Checkpoints are layout-free: tensors are stored by global name and offset, so a checkpoint
written at one TP/PP/DP loads at another. The optimizer state uses the 'fully_reshardable'
format for the same reason. A save goes to `<dir>.tmp-<n>` and is renamed into place only after
every rank finished, so an interrupted save never leaves a directory that looks complete.

A LoRA run's checkpoint holds what trains (the adapters, a value head, their optimizer state)
and a reference to the frozen base it trained over (its completion marker's 'base': the base
checkpoint's path and a fingerprint of its weights): loading it loads that base first. A run
whose base is no checkpoint (an SFT preset's seeded initialisation) saves every weight.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
import torch.distributed as dist
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.dist_checkpointing.mapping import (
    ShardedBase, ShardedTensor, ShardedTensorFactory,
)
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from megarlhf.compat.megatron import (
    load_dist_checkpoint, save_dist_checkpoint, torch_adam_load_fixes,
)
from megarlhf.models.arch import Architecture, architecture_for_model
from megarlhf.models.config import ModelConfig
from megarlhf.engine.optim import OptimConfig
from megarlhf.engine.train import TrainEngine
from megarlhf.integrity import (checkpoint_weights_fingerprint, read_json,
                                verify_checkpoint_collectively)
from megarlhf.models.gpt import ModelSpec, model_spec
from megarlhf.models.lora import LoraConfig, is_adapter_key
from megarlhf.models.transformer_config import dtype_name
from megarlhf.parallel.mesh import Mesh, ParallelConfig

COMPLETE_MARKER = "megarlhf_complete.json"
HF_SIDECAR = "hf"
"""Subdirectory with the HF config and tokenizer files of the model's source, if any."""
_OPTIM_METADATA = {"distrib_optim_sharding_type": "fully_reshardable"}
HEAD_PREFIX = "value_head."


def is_trained_key(name: str) -> bool:
    """A tensor that trains under LoRA (an adapter factor or a value head): what an
    adapter-only checkpoint holds."""
    return is_adapter_key(name) or name.startswith(HEAD_PREFIX)


def _sharded_state(engine, *, is_loading: bool, with_optimizer: bool,
                   adapters_only: bool = False) -> dict:
    """The engine's state as megatron-core's sharded dicts; `adapters_only`: of the model,
    only what trains under LoRA (the optimizer holds nothing else)."""
    model_sd = {f"chunk{i}": {k: v for k, v in chunk.sharded_state_dict().items()
                              if not adapters_only or is_trained_key(k)}
                for i, chunk in enumerate(engine.unwrapped())}
    state = {"model": model_sd}
    if with_optimizer and engine.optimizer is not None:
        state["optimizer"] = engine.optimizer.sharded_state_dict(
            _merged(model_sd), is_loading=is_loading, metadata=_OPTIM_METADATA
        )
        state["scheduler"] = engine.scheduler.state_dict()
    return state


def _merged(model_sd: dict) -> dict:
    # The optimizer maps its parameters to checkpoint keys through one flat model dict.
    merged = {}
    for i, sd in enumerate(model_sd.values()):
        merged.update({f"{i}.{k}": v for k, v in sd.items()})
    return merged


def _keys(sharded) -> set[str]:
    """The checkpoint keys a load of the sharded state dict `sharded` reads: those of its
    tensors and objects, and of what its factories build (e.g. the halves of a fused MLP)."""
    keys = set()
    for value in nested_values(sharded):
        if isinstance(value, ShardedTensorFactory):
            built = value.build()
            keys |= _keys(built if isinstance(built, (dict, list)) else [built])
        elif isinstance(value, ShardedBase):
            keys.add(value.key)
    return keys


def _has_state(optimizer) -> bool:
    if optimizer is None:
        return False
    inner = [opt.optimizer for opt in getattr(optimizer, "chained_optimizers", [optimizer])]
    return any(o is not None and o.state for o in inner)


def _materialise_optimizer_state(optimizer) -> None:
    """Give a fresh optimizer its state tensors so a loading template can be built.

    megatron-core's distributed optimizer reads the torch optimizer's per-parameter 'step'
    while building the template, and a fresh optimizer has none. One zero-LR step creates every
    state tensor without moving a weight; the load then overwrites all of them.
    """
    for opt in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = opt.optimizer
        if inner is None or inner.state:
            continue
        saved_lrs = [group["lr"] for group in inner.param_groups]
        for group in inner.param_groups:
            group["lr"] = 0.0
            for p in group["params"]:
                p.grad = torch.zeros_like(p)
        inner.step()
        inner.zero_grad(set_to_none=True)
        for group, lr in zip(inner.param_groups, saved_lrs):
            group["lr"] = lr


def _read_hf_files(directory: str) -> dict[str, bytes]:
    if not os.path.isdir(directory):
        return {}
    files = {}
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            files[name] = f.read()
    return files


def _write_hf_files(directory: str, files: dict[str, bytes]) -> None:
    if files:
        os.makedirs(directory)
    for name, data in files.items():
        with open(os.path.join(directory, name), "wb") as f:
            f.write(data)


def is_complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, COMPLETE_MARKER))


def checkpoint_meta(model: ModelConfig, *, value_head: bool, dtype: torch.dtype, layout: dict,
                    with_optimizer: bool, architecture: str | None = None,
                    extra: dict | None = None, lora: dict | None = None,
                    base: dict | None = None) -> dict:
    """What the completion marker records: enough to rebuild and export the model anywhere.
    `base`: an adapter-only checkpoint's base, {"path", "sha256"} (base_reference)."""
    return {
        "layout": layout,
        "with_optimizer": with_optimizer,
        "model": model.to_dict(),
        "value_head": value_head,
        "dtype": dtype_name(dtype),
        "architecture": architecture,
        "extra": extra or {},
        "lora": lora,
        "base": base,
    }


def publish(tmp: str, path: str, meta: dict) -> None:
    """Mark the fully written directory `tmp` complete and move it to `path` (single writer)."""
    with open(os.path.join(tmp, COMPLETE_MARKER), "w") as f:
        json.dump(meta, f, indent=1)
    replace_dir(tmp, path)


def replace_dir(tmp: str, path: str) -> None:
    """Move `tmp` to `path`, replacing what is there (callers check it is ours); the old one is
    deleted only after the new one is in place, so a crash at any point leaves at least one
    complete directory. The old one waits under a hidden name no user directory has."""
    parent, name = os.path.split(path)
    old = os.path.join(parent, f".{name}.megarlhf-old")
    if os.path.exists(path):
        shutil.rmtree(old, ignore_errors=True)
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


def checkpoint_architecture(meta: dict) -> Architecture:
    """The architecture a checkpoint (its completion marker `meta`) was converted from, else
    the one its model fits."""
    return architecture_for_model(ModelConfig.from_dict(meta["model"]), meta.get("architecture"))


def read_meta(path: str) -> dict:
    """The completion marker of a checkpoint; ValueError if there is none, CorruptFileError
    if it does not read as JSON."""
    if not is_complete(path):
        raise ValueError(
            f"{path} is not a complete megarlhf checkpoint (no {COMPLETE_MARKER}); it may be "
            f"missing or an interrupted save"
        )
    return read_json(os.path.join(path, COMPLETE_MARKER))


def save_checkpoint(path: str, engine, mesh: Mesh, *, extra: dict | None = None,
                    with_optimizer: bool = True) -> None:
    """Write `engine`'s state to `path` (all ranks call this). `extra` is JSON metadata. An
    engine training LoRA adapters over a base checkpoint writes only what trains, and the
    base's reference."""
    path = os.path.abspath(path)
    base = engine.provenance.get("base")
    tmp = f"{path}.tmp"
    # An optimizer that has not stepped has no state to save (and megatron-core cannot describe
    # it); such a checkpoint is marked as model-only.
    if with_optimizer:
        flag = torch.tensor([int(_has_state(engine.optimizer))], device=mesh.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # every rank must take the same path
        with_optimizer = bool(flag.item())
    if mesh.rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    dist.barrier()
    save_dist_checkpoint(_sharded_state(engine, is_loading=False, with_optimizer=with_optimizer,
                                        adapters_only=base is not None), tmp)
    dist.barrier()
    if mesh.rank == 0:
        layout = {"tp": mesh.tp, "pp": mesh.pp, "cp": mesh.cp, "ep": mesh.ep, "dp": mesh.dp_size,
                  "vpp": mesh.config.virtual_pipeline_parallel}
        spec = engine.spec
        _write_hf_files(os.path.join(tmp, HF_SIDECAR), engine.provenance["hf_files"])
        publish(tmp, path, checkpoint_meta(
            spec.model, value_head=spec.value_head, dtype=spec.transformer.params_dtype,
            layout=layout, with_optimizer=with_optimizer,
            architecture=engine.provenance["architecture"], extra=extra,
            lora=spec.lora.to_dict() if spec.lora else None, base=base))
    dist.barrier()


_SHAPE_FIELDS = ("vocab_size", "hidden_size", "ffn_hidden_size", "num_layers",
                 "num_attention_heads", "kv_heads", "kv_channels", "qkv_bias", "qk_norm",
                 "tie_embeddings", "num_experts", "moe_ffn_hidden_size", "mrope_section",
                 "vision", "image_token_id")


def _check_same_model(path: str, meta: dict, spec: ModelSpec) -> None:
    saved, ours = ModelConfig.from_dict(meta["model"]), spec.model
    diffs = [f"{k}: checkpoint {getattr(saved, k)!r} vs model {getattr(ours, k)!r}"
             for k in _SHAPE_FIELDS if getattr(saved, k) != getattr(ours, k)]
    if meta["value_head"] != spec.value_head:
        diffs.append(f"value head: checkpoint {meta['value_head']} vs model {spec.value_head}")
    saved_lora = adapter_shape(meta.get("lora"))
    our_lora = adapter_shape(spec.lora and spec.lora.to_dict())
    if saved_lora is not None and saved_lora != our_lora:
        raise ValueError(
            f"{path} holds LoRA adapters {saved_lora}, the model being loaded into "
            f"{our_lora or 'none'}: load it with the "
            f"same lora settings, or export it merged (python -m tools.convert_hf.mcore_to_hf "
            f"--ckpt {path} --out DIR) and convert that back")
    if diffs:
        raise ValueError(f"{path} holds a different model than the one being loaded into: "
                         + "; ".join(diffs) + f". Build the model from the checkpoint's own "
                         f"config ({COMPLETE_MARKER}, key 'model') or load a matching checkpoint")


def adapter_shape(lora: dict | None) -> dict | None:
    """What of a checkpoint's LoRA settings its tensors depend on (not the init or seed)."""
    if lora is None:
        return None
    return {k: lora[k] for k in ("rank", "alpha", "use_rslora", "target_modules")}


def base_reference(path: str) -> dict:
    """What an adapter-only checkpoint records of the base checkpoint at `path`."""
    return {"path": os.path.abspath(path), "sha256": checkpoint_weights_fingerprint(path)}


def base_checkpoint(path: str, meta: dict, moved: str | None = None, *,
                    field: str | None = None) -> str:
    """Where the base of the adapter-only checkpoint `path` (completion marker `meta`) is:
    its recorded path, else `moved` (where the caller now says it is), whichever holds the
    weights it trained over; ValueError (one line, naming both, and `field`: how the caller
    names a moved base) when neither does."""
    recorded = meta["base"]
    found = []
    for candidate in dict.fromkeys(p for p in (recorded["path"], moved) if p):
        if not is_complete(candidate):
            found.append(f"{candidate} is no complete checkpoint")
        elif checkpoint_weights_fingerprint(candidate) != recorded["sha256"]:
            found.append(f"{candidate} holds other weights")
        else:
            return candidate
    moved_fix = f", or give where it moved with {field}" if field else ""
    raise ValueError(f"{path} holds LoRA adapters trained over the base {recorded['path']} "
                     f"(weights {recorded['sha256'][:12]}), but {'; '.join(found)}: restore "
                     f"that base{moved_fix}")


def check_resumed_adapters(path: str, lora: LoraConfig | None, field: str, *,
                           base: str | None = None, base_field: str | None = None) -> None:
    """A resume from checkpoint `path` keeps its adapters: ValueError (one line, naming the
    recipe's `field`) when `lora` would train other ones, or adapters over its full weights,
    or full weights where it trained adapters; and an adapter-only checkpoint finds its base
    (base_checkpoint, `base` the recipe's, named by `base_field`). Read in the launching
    process."""
    meta = read_meta(path)
    if meta.get("base"):
        found = base_checkpoint(path, meta, base, field=base_field)
        # The recipe naming another model (resume_allow_changes) cannot swap the base.
        if base and os.path.abspath(base) != found and is_complete(base) and \
                checkpoint_weights_fingerprint(base) != meta["base"]["sha256"]:
            raise ValueError(f"cannot resume from {path}: its adapters trained over {found}, "
                             f"{base_field} now gives {base}, other weights; adapters keep "
                             f"their base: resume over it, or start a new run")
    saved = adapter_shape(meta.get("lora"))
    ours = adapter_shape(lora and lora.to_dict())
    if saved != ours:
        trained = f"LoRA adapters {saved}" if saved else "every weight (no LoRA)"
        raise ValueError(f"cannot resume from {path}: it trained {trained}, {field} now gives "
                         f"{f'adapters {ours}' if ours else 'none'}; resume with the "
                         f"checkpoint's settings, or start a new run from it")


def engine_from_checkpoint(path: str, parallel: ParallelConfig, mesh: Mesh,
                           optim: OptimConfig | None = None, *, lora: LoraConfig | None = None,
                           **spec) -> TrainEngine:
    """An engine at `parallel` holding the checkpoint's model (its config, head and LoRA
    adapters from the metadata) and weights, cast to `spec`'s dtype when it differs; `spec`:
    model_spec's keyword arguments (dtype, layer_spec, on_gpu, recompute). The optimizer, if any, starts
    fresh. `parallel` may add sequence parallelism to `mesh`'s layout (a per-model flag).
    `lora`: adapters to train over a base checkpoint (a checkpoint's own come with it)."""
    meta = read_meta(path)
    if meta.get("lora"):  # the checkpoint's adapters come with their settings
        saved = LoraConfig(**meta["lora"])
        if lora is not None and adapter_shape(lora.to_dict()) != adapter_shape(saved.to_dict()):
            raise ValueError(f"{path} holds LoRA adapters {adapter_shape(saved.to_dict())}, "
                             f"not the {adapter_shape(lora.to_dict())} asked for")
        lora = saved
    engine = TrainEngine(model_spec(ModelConfig.from_dict(meta["model"]), parallel,
                                    value_head=meta["value_head"], lora=lora, **spec),
                         mesh, optim)
    load_checkpoint(path, engine, with_optimizer=False)
    return engine


def load_checkpoint(path: str, engine, *, with_optimizer: bool = True,
                    base: str | None = None) -> dict:
    """Load a checkpoint written at any layout into `engine`; returns the `extra` metadata.
    An adapter-only checkpoint loads its base first (base_checkpoint; `base`: where the
    recipe says it is), unless the engine holds that base already (it is frozen)."""
    meta = read_meta(path)
    _check_same_model(path, meta, engine.spec)
    recorded = meta.get("base")
    held = engine.provenance.get("base")
    if recorded is not None and (held is None or held["sha256"] != recorded["sha256"]):
        load_base(base_checkpoint(path, meta, base), engine)
    with_optimizer = with_optimizer and engine.optimizer is not None
    if with_optimizer and not meta["with_optimizer"]:
        raise ValueError(f"{path} holds no optimizer state; load with with_optimizer=False")
    if with_optimizer:
        _materialise_optimizer_state(engine.optimizer)
    template = _sharded_state(engine, is_loading=True, with_optimizer=with_optimizer,
                              adapters_only=recorded is not None)
    # A fresh 16-bit optimizer's fp32 master weights start at the checkpoint's values where it
    # holds them wider: read into fp32 host tensors, then cast into the model.
    # (Not under LoRA: its 16-bit base weights are frozen, with no masters.)
    wide_masters = (not with_optimizer and meta["dtype"] == "fp32" and engine.spec.lora is None
                    and engine.dtype != torch.float32 and _exact_masters(engine.optimizer))
    if wide_masters:
        _widen(template["model"])
    # A base checkpoint (no adapters) loaded under LoRA: the adapters keep their initial
    # values (B = 0, the base model), every other tensor is read. It becomes the base this
    # engine's checkpoints refer to.
    base_only = engine.spec.lora is not None and meta.get("lora") is None
    if base_only:
        template["model"] = {c: {k: v for k, v in sd.items() if not is_adapter_key(k)}
                             for c, sd in template["model"].items()}
    # What the template left out (and only that) stays as it is.
    kept = is_adapter_key if base_only else _is_frozen if recorded else None
    verify_checkpoint_collectively(path, _keys(template))  # megatron-core's load checks none
    loaded = load_dist_checkpoint(template, path)
    for chunk, sd in zip(engine.unwrapped(), loaded["model"].values()):
        result = chunk.load_state_dict(sd, strict=kept is None)
        missing = [k for k in result.missing_keys if kept is None or not kept(k)]
        assert not missing and not result.unexpected_keys, (missing, result.unexpected_keys)
    engine.provenance = {"architecture": meta.get("architecture"),
                         "hf_files": _read_hf_files(os.path.join(path, HF_SIDECAR)),
                         "base": (base_reference(path) if base_only
                                  else engine.provenance.get("base") if recorded else None)}
    if with_optimizer:
        with torch_adam_load_fixes(engine.optimizer):
            engine.optimizer.load_state_dict(loaded["optimizer"])
        engine.scheduler.load_state_dict(loaded["scheduler"])
    elif engine.optimizer is not None:
        # A 16-bit engine's optimizer holds fp32 master copies of the weights, made when it
        # was built: refresh them from the loaded weights, or the first step writes the
        # build-time init back over them. From an fp32 checkpoint, its values: masters
        # rounded to 16 bits sit on the 16-bit grid, so an update below half a 16-bit step
        # never moves the model's weights until the updates add up to one, where masters off
        # the grid move about that fraction of them (Adam at lr 1e-5 on SmolLM2-135M in bf16:
        # 3.8% of the weights moved after 5 steps, 8.8% from the fp32 values; BENCHMARKS.md).
        engine.optimizer.reload_model_params(
            state_dict={f"model{i}": sd for i, sd in enumerate(loaded["model"].values())}
            if wide_masters else None)
    return meta["extra"]


def _is_frozen(name: str) -> bool:
    return not is_trained_key(name)


def load_base(path: str, engine) -> None:
    """Load the full checkpoint `path` as the weights `engine` starts from (and under LoRA
    trains adapters over; its checkpoints then refer to it): the whole model, or a value
    model's trunk from a language model (every tensor but the head, which keeps its seeded
    initialisation; the LM's output layer is not read)."""
    meta = read_meta(path)
    if meta["value_head"] == engine.spec.value_head:
        load_checkpoint(path, engine, with_optimizer=False)
        return
    assert engine.spec.value_head, f"{path}: a value model's checkpoint cannot start an LM"
    for chunk in engine.unwrapped():
        template = {k: v for k, v in chunk.sharded_state_dict().items()
                    if not is_trained_key(k)}
        # The load also returns the checkpoint's non-tensor state (optimizer, schedule),
        # which is not ours to take.
        loaded = load_dist_checkpoint(template, path)
        result = chunk.load_state_dict({k: loaded[k] for k in template}, strict=False)
        missing = [k for k in result.missing_keys if not is_trained_key(k)]
        assert not missing and not result.unexpected_keys, (missing, result.unexpected_keys)
    engine.provenance = {"architecture": meta.get("architecture"),
                         "hf_files": _read_hf_files(os.path.join(path, HF_SIDECAR)),
                         "base": base_reference(path) if engine.spec.lora else None}
    engine.refresh_masters()


def _exact_masters(optimizer) -> bool:
    """Whether `optimizer` can start its master weights from given fp32 tensors: megatron-core
    does that for its distributed optimizer only, and (0.16) hands the tensors to the first
    of several chained optimizers only (a mixture-of-experts model's dense and expert ones)
    and matches parameter names by substring (expert weight1 in weight10): so one distributed
    optimizer, and the other cases keep masters rounded from the model."""
    if optimizer is None:
        return False
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return len(inner) == 1 and isinstance(inner[0], DistributedOptimizer)


def _widen(model_template: dict) -> None:
    """Give the template's tensors fp32 host buffers of their shapes to load into."""
    for value in nested_values(model_template):
        if isinstance(value, (ShardedTensor, ShardedTensorFactory)) and value.data is not None \
                and value.data.is_floating_point():
            value.data = torch.empty(value.data.shape, dtype=torch.float32)
            if isinstance(value, ShardedTensor):
                value.dtype = torch.float32
