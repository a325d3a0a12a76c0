"""The models of a PPO job's roles, read without loading any weight: which recipe field holds
each role's model (MODEL_ROLES), the architecture behind that path (resolve_models), and what
makes them unrunnable at the recipe's layout (check_models). The run's checks before any rank
starts (preflight.py), `megarlhf data` and the memory planner (megarlhf/plan) all read them
here.

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

from megarlhf.convert.peft_adapter import check_adapter
from megarlhf.engine.checkpoint import is_complete, read_meta
from megarlhf.models.config import ModelConfig
from megarlhf.models.lora import check_model as check_lora_targets
from megarlhf.models.presets import preset
from megarlhf.models.vision import refuse_in_stages
from megarlhf.parallel.mesh import ParallelConfig
from megarlhf.ppo.config import PPOConfig
from megarlhf.ppo.layout import group_specs

PRESET_PREFIX = "preset:"

MODEL_ROLES = {"actor": ("actor", False, True), "ref": ("actor", False, False),
               "critic": ("critic", True, True), "reward": ("reward_model", True, False),
               "teacher": ("teacher", False, False)}
"""role -> (PPOConfig field with its checkpoint, value head, trained)."""


@dataclasses.dataclass(frozen=True)
class ModelSource:
    model: ModelConfig
    value_head: bool
    origin: str
    """Where the shape came from, for the report ('checkpoint', 'HF config', 'preset')."""


def resolve(path: str, *, field: str, value_head: bool, lora: bool = False) -> ModelSource:
    """The shape of the model at `path` (the recipe's `field`); `value_head` is what its role
    needs (critic and reward: True); `lora`: a checkpoint with LoRA adapters may serve (a
    judge's weights are streamed with them merged). A checkpoint that disagrees is
    refused."""
    if path.startswith(PRESET_PREFIX):
        return ModelSource(preset(path[len(PRESET_PREFIX):]), value_head, "preset")
    if is_complete(path):
        meta = read_meta(path)
        if meta.get("lora") and not lora:
            peft = ("start from its base with layout.actor.lora.from_peft=DIR (DIR from "
                    "python -m tools.convert_hf.mcore_to_hf --lora adapter), or "
                    if field == "actor" else "")
            raise ValueError(f"{field}: checkpoint {path} holds LoRA adapters: {peft}export it "
                             f"merged (python -m tools.convert_hf.mcore_to_hf) and convert "
                             f"that back")
        if meta["value_head"] != value_head:
            kind = "a value head" if meta["value_head"] else "an LM head"
            raise ValueError(f"{field}: checkpoint {path} has {kind}, the role needs "
                             f"{'a value head' if value_head else 'an LM head'}")
        return _text_only(ModelSource(ModelConfig.from_dict(meta["model"]), value_head,
                                      "checkpoint"), f"{field} {path}")
    if os.path.isfile(os.path.join(path, "config.json")):
        return _text_only(ModelSource(_from_hf(path), value_head, "HF config"),
                          f"{field} {path}")
    hint = ("it does not exist yet" if not os.path.exists(path)
            else "it is neither a megarlhf checkpoint nor an HF model directory")
    raise ValueError(f"{field}: cannot read the model shape from {path!r}: {hint}. Convert "
                     f"it first (tools/convert_hf), or plan with {field}=preset:NAME (presets: "
                     f"megarlhf.models.presets)")


def _text_only(source: ModelSource, where: str) -> ModelSource:
    refuse_in_stages(source.model, where)
    return source


TEACHER_LOGP = "teacher_logp:"
"""The experience pass's key of each teacher's logprobs, before its name (PPOConfig.teachers);
the controller keeps each row's own teacher's as `teacher_logp`."""


def role_of(name: str) -> str:
    """The model role (a key of MODEL_ROLES) of a model of the job: the role itself, or
    "teacher" for each of the run's teachers (PPOConfig.teachers)."""
    return "teacher" if name.startswith("teacher") else name


def field_of(name: str) -> str:
    """The recipe field giving a model's path (a teacher's name is its field)."""
    return name if role_of(name) == "teacher" else MODEL_ROLES[name][0]


def model_paths(config: PPOConfig) -> dict[str, str]:
    """Model -> its path, for the roles this job has: a model per role, and one per
    distinct teacher under its name."""
    roles = set().union(*(spec.roles for spec in group_specs(config)))
    paths = {}
    for role, (field, _, _) in MODEL_ROLES.items():
        if role == "teacher" and role in roles:
            paths.update(config.teachers)
        elif role in roles:
            paths[role] = getattr(config, field)
    return paths


def resolve_models(config: PPOConfig) -> dict[str, ModelSource]:
    """Model (model_paths' names) -> its shape, for the roles this job has."""
    return {name: resolve(path, field=field_of(name),
                          value_head=MODEL_ROLES[role_of(name)][1])
            for name, path in model_paths(config).items()}


def check_models(config: PPOConfig, models: dict[str, ModelSource], seq: int) -> list[str]:
    """What makes the models unrunnable at the recipe's layout, each with a fix."""
    problems = []
    for role in ("actor", "critic"):
        lora = config.lora_of(role)
        if lora is not None and role in models:
            try:
                check_lora_targets(lora, is_moe=models[role].model.is_moe)
                if lora.from_peft is not None:
                    check_adapter(lora.from_peft, models[role].model, lora)
            except ValueError as e:
                problems.append(f"{role}: {e}")
    for role, source in models.items():
        training = config.parallel_of(role)
        if role == "ref" and "actor" in models and training == config.parallel_of("actor"):
            continue  # the actor's checkpoint at the actor's layout, checked as the actor
        try:
            source.model.check_parallel(training if source.model.is_moe
                                        else training.without_experts(),
                                        training=role in ("actor", "critic"))
        except ValueError as e:
            problems.append(f"{role}: {e}")
        if seq > source.model.max_position_embeddings:
            problems.append(f"{role}: a prompt + response of {seq} tokens exceeds the model's "
                            f"max_position_embeddings={source.model.max_position_embeddings}; "
                            f"lower max_new_tokens or the prompt length")
    split = [f"{r} {config.parallel_of(r).expert_parallel}" for r in models
             if config.parallel_of(r).expert_parallel > 1]
    if split and not any(source.model.is_moe for source in models.values()):
        problems.append(f"expert_parallel > 1 ({', '.join(split)}), but no model of this run "
                        f"is a mixture of experts: set it to 1")
    try:
        models["actor"].model.check_parallel(ParallelConfig(tensor_parallel=config.rollout_tp))
    except ValueError as e:
        problems.append(f"rollout engines (layout.rollout.tensor_parallel={config.rollout_tp}): "
                        f"{e}")
    return problems


def _from_hf(path: str) -> ModelConfig:
    import transformers

    from megarlhf.models.arch import architecture_for_hf_config

    config = transformers.AutoConfig.from_pretrained(path)
    arch, _ = architecture_for_hf_config(config, path)
    return arch.model_config(config)
