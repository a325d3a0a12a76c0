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

from megarlhf.data.tokenizer import eos_token_ids, tokenizer_fingerprint
from megarlhf.engine.checkpoint import HF_SIDECAR
from megarlhf.ppo.config import PPOConfig
from megarlhf.ppo.judge import judge_model
from megarlhf.ppo.sources import (check_models, field_of, model_paths, resolve_models,
                                  role_of)
from megarlhf.rollout.sizing import (EngineSize, vllm_head_dim_problem,
                                     vllm_token_logprobs_problem)

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Preflight:
    stop_token_ids: tuple[int, ...]
    """What ends a sample, in both rollout engines: config.stop_token_ids, or the actor's EOS
    ids when it is None."""
    engine_size: EngineSize | None
    """The vLLM engines' length and KV cache (None with Megatron rollouts)."""
    overlong: tuple[int, ...] = ()
    """Indices of the prompts skip_overlong drops."""
    max_prompt_tokens: int | None = None
    """The longest prompt a sample may start from next to max_new_tokens (the models'
    positions, the vLLM engines' length): an environment's reset messages must keep within
    it."""
    teacher_sizes: dict[str, EngineSize] = dataclasses.field(default_factory=dict)
    """With teacher_backend=vllm: each teacher's (PPOConfig.teachers' name) engine size."""


def preflight(config: PPOConfig, prompts: list[list[int]],
              where: list[str] | None = None) -> Preflight:
    """Raise ValueError naming every problem and its fix, for what the ranks would fail on.
    `where`: each prompt's place in its file ('file:line', 'file:row N'; default: the
    prompts file and the prompt's number). `megarlhf ppo --dry-run` runs the same checks."""
    where = where or [f"{config.prompts}:{i}" for i in range(1, len(prompts) + 1)]
    models = resolve_models(config)
    problems = _vocabulary_problems(config, models)
    limit, what, fix = fit_limit(config, models)
    overlong = _overlong(config, limit, prompts)
    if overlong and not config.skip_overlong:
        first = overlong[0]
        problems.append(f"prompt {where[first]}: a prompt of "
                        f"{len(prompts[first])} tokens + max_new_tokens={config.max_new_tokens} "
                        f"does not fit {what} ({len(overlong)} prompt(s) in all); shorten them, "
                        f"lower max_new_tokens{fix}, or set skip_overlong=true to drop them")
    elif overlong:
        if len(overlong) == len(prompts):
            raise ValueError(f"prompts {config.prompts}: skip_overlong drops every prompt; "
                             f"none fits {what}")
        log.warning("skip_overlong: dropping %d of %d prompts longer than %s allows",
                    len(overlong), len(prompts), what)
    dropped = set(overlong)  # reported above; check_models checks what remains
    longest = max((len(p) for i, p in enumerate(prompts) if i not in dropped), default=0)
    problems += check_models(config, models, longest + config.max_new_tokens)
    budget = config.max_tokens_per_micro_batch
    if budget is not None:
        # Each role pads a row to its multiple: 2 x CP under context parallelism, times TP
        # under sequence parallelism.
        length = longest + config.max_new_tokens
        need = max(-(-length // p.sequence_multiple) * p.sequence_multiple
                   for p in map(config.parallel_of, models))
        if budget < need:
            problems.append(f"max_tokens_per_micro_batch={budget} cannot hold the longest "
                            f"prompt ({longest} tokens) + max_new_tokens="
                            f"{config.max_new_tokens}; raise it to at least {need}")
    # A teacher may be an HF directory: its tensors are streamed in at launch.
    problems += [f"{name}: {path} is an HF model directory, not a megarlhf "
                 f"checkpoint; convert it first (python -m tools.convert_hf.hf_to_mcore --hf "
                 f"DIR --out CKPT [--role critic|reward])"
                 for name, path in model_paths(config).items()
                 if role_of(name) not in ("ref", "teacher")
                 and models[name].origin != "checkpoint"]
    problems += _hf_teacher_problems(config, models)
    problems += _vllm_teacher_problems(config, models)
    if config.rollout_backend == "vllm" and not os.path.isfile(
            os.path.join(config.vllm_model_dir, "config.json")):
        problems.append(f"vllm_model_dir {config.vllm_model_dir} has no config.json (an HF "
                        f"directory with the actor's config, e.g. its mcore_to_hf export)")
    if problems:  # what follows reads the actor's checkpoint
        raise ValueError("the run cannot start:\n  " + "\n  ".join(problems))
    model = models["actor"].model
    if config.routing_replay and not model.is_moe:
        problems.append(f"routing_replay=true: the actor {config.actor} is a dense model (no "
                        f"experts to route); set routing_replay=false")
    outside = [i for i, p in enumerate(prompts) if max(p) >= model.vocab_size]
    if outside:
        first = outside[0]
        problems.append(f"prompt {where[first]}: token id "
                        f"{max(prompts[first])} is outside the actor's vocabulary "
                        f"({model.vocab_size}; {len(outside)} prompt(s) in all); were they "
                        f"tokenized with another tokenizer?")
    stop_ids = config.stop_token_ids
    if stop_ids is None:
        stop_ids = _actor_eos_ids(config.actor)
    bad_stops = [i for i in stop_ids if not 0 <= i < model.vocab_size]
    if bad_stops:
        problems.append(f"stop_token_ids {bad_stops} are outside the actor's vocabulary "
                        f"({model.vocab_size})")
    size = None
    vllm_judge = config.reward_judge is not None and config.reward_judge.backend == "vllm"
    vllm_teacher = config.teacher_backend == "vllm"
    if (config.rollout_backend == "vllm" or vllm_judge or vllm_teacher) and \
            config.rollout_cuda_graphs and \
            not torch.cuda.is_available():
        problems.append("rollout_cuda_graphs=true needs CUDA (there is no GPU here); "
                        "leave it false on CPU")
    if config.rollout_backend == "vllm":
        problem = vllm_head_dim_problem(model)
        if problem:
            problems.append(f"rollout_backend=vllm: {problem}; use rollout_backend=megatron")
        try:
            size = config.vllm_engine_size(model, longest)
        except ValueError as e:
            problems.append(str(e))
    if problems:
        raise ValueError("the run cannot start:\n  " + "\n  ".join(problems))
    room = min(limit, size.max_model_len) if size is not None else limit
    # An episode's transcript may take the room its reset messages leave; a sample, its
    # prompt and max_new_tokens.
    typical = longest + config.max_new_tokens
    teacher_sizes = {name: config.teacher_engine_size(models[name].model,
                                                      room if config.episodic else typical,
                                                      typical)
                     for name in config.teachers} if vllm_teacher else {}
    return Preflight(stop_token_ids=tuple(stop_ids), engine_size=size,
                     max_prompt_tokens=room - config.max_new_tokens,
                     overlong=tuple(overlong) if config.skip_overlong else (),
                     teacher_sizes=teacher_sizes)


def fit_limit(config: PPOConfig, models: dict) -> tuple[int, str, str]:
    """The most tokens a prompt + response may take, what sets it, and the fix it allows."""
    role, source = min(models.items(), key=lambda kv: kv[1].model.max_position_embeddings)
    positions = source.model.max_position_embeddings
    if config.rollout_backend == "vllm" and config.rollout_max_model_len is not None \
            and config.rollout_max_model_len < positions:
        return (config.rollout_max_model_len,
                f"rollout_max_model_len={config.rollout_max_model_len}",
                ", raise rollout_max_model_len")
    return positions, f"the {role} model's max_position_embeddings={positions}", ""


def _overlong(config: PPOConfig, limit: int, prompts: list[list[int]]) -> list[int]:
    if config.max_new_tokens >= limit:  # no prompt fits: check_models names max_new_tokens
        return []
    return [i for i, p in enumerate(prompts) if len(p) + config.max_new_tokens > limit]


def _hf_teacher_problems(config: PPOConfig, models: dict) -> list[str]:
    """What the ranks would fail on streaming an HF-directory teacher's tensors (each named
    with its tensor rules' shapes), read here from the files' headers."""
    problems = []
    for name, path in config.teachers.items():
        if name in models and models[name].origin == "HF config":
            try:
                judge_model(path, name)
            except ValueError as e:
                problems.append(str(e))
    return problems


def _vllm_teacher_problems(config: PPOConfig, models: dict) -> list[str]:
    """With teacher_backend=vllm: each teacher an HF directory whose heads vLLM serves here."""
    if config.teacher_backend != "vllm":
        return []
    problem = vllm_token_logprobs_problem()
    if problem:
        return [f"teacher_backend=vllm: {problem}; upgrade it, or use teacher_backend=megatron"]
    if torch.cuda.is_available() and len(config.teachers) > 1:
        # vLLM's sleep-mode allocator and its free-memory check at start serve one engine
        # per process on CUDA; several have run on CPU only.
        return [f"teacher_backend=vllm with {len(config.teachers)} teachers: one vLLM engine "
                f"per process on GPUs (several not run yet); use teacher_backend=megatron for "
                f"teacher_by_source"]
    problems = []
    for name, path in config.teachers.items():
        if name not in models:
            continue
        if models[name].origin == "checkpoint":
            problems.append(f"{field_of(name)}: {path} is a megarlhf checkpoint; "
                            f"teacher_backend=vllm reads an HF directory: export it (python -m "
                            f"tools.convert_hf.mcore_to_hf --ckpt {path} --out DIR) or use "
                            f"teacher_backend=megatron")
            continue
        if models[name].origin != "HF config":
            problems.append(f"{field_of(name)}: teacher_backend=vllm reads an HF directory, "
                            f"{path} is a {models[name].origin}")
            continue
        problem = vllm_head_dim_problem(models[name].model)
        if problem:
            problems.append(f"{field_of(name)} on teacher_backend=vllm: {problem}; use "
                            f"teacher_backend=megatron")
    return problems


def _vocabulary_problems(config: PPOConfig, models: dict) -> list[str]:
    """Every model reads the actor's token ids: the same vocabulary (unpadded: padded sizes
    legitimately differ with TP) and, where their files say, the same tokenizer."""
    actor = models["actor"].model.vocab_size
    problems = [f"{field_of(name)}: its vocabulary has {source.model.vocab_size} tokens, the "
                f"actor's {actor}; it must share the actor's tokenizer (train it from the same "
                f"base model)"
                for name, source in models.items()
                if name != "ref" and source.model.vocab_size != actor]
    # An HF directory holds its tokenizer files; a checkpoint, its hf/ sidecar.
    tokenizers = {field_of(name): tokenizer_fingerprint(
                      path if models[name].origin == "HF config"
                      else os.path.join(path, HF_SIDECAR))
                  for name, path in model_paths(config).items() if name != "ref"}
    if config.rollout_backend == "vllm" and config.vllm_model_dir:
        tokenizers["vllm_model_dir"] = tokenizer_fingerprint(config.vllm_model_dir)
    mine = tokenizers.pop("actor")
    problems += [f"{field}: its tokenizer files differ from the actor's (another vocabulary, "
                 f"merges or special tokens); every role must tokenize like the actor"
                 for field, theirs in tokenizers.items()
                 if mine is not None and theirs is not None and theirs != mine]
    return problems


def _actor_eos_ids(actor: str) -> tuple[int, ...]:
    sidecar = os.path.join(actor, HF_SIDECAR)
    ids = eos_token_ids(sidecar) if os.path.isdir(sidecar) else ()
    if not ids:
        log.warning("the actor checkpoint %s names no EOS token (no config / tokenizer files "
                    "in %s): every sample runs to max_new_tokens; set stop_token_ids to end "
                    "them", actor, sidecar)
    return ids
