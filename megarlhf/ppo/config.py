"""The PPO run's configuration: one frozen dataclass, validated before any process starts.

Recipes (a YAML file of these fields, or a `module:function` returning a `PPOConfig`) and
`key=value` overrides are read by `megarlhf.configio.load_config`, as every command's are.
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import ClassVar

from megarlhf.data.config import BAD_RECORD_POLICIES, TEMPLATES
from megarlhf.data.records import KIND_FIELDS, OPTIONAL_FIELDS
from megarlhf.envs.episodes import ENV_ERROR_POLICIES
from megarlhf.envs.tools import PARSERS
from megarlhf import profiling
from megarlhf.metrics import missing_dashboards
from megarlhf.models.config import ModelConfig
from megarlhf.models.lora import LoraConfig, layout_problem
from megarlhf.models.specs import TE_REFUSED
from megarlhf.parallel.mesh import LayoutOverride, ParallelConfig
from megarlhf.rollout import sizing
from megarlhf.rollout.gap import GAP_POLICIES, GapLimits
from megarlhf.rollout.sizing import EngineSize
from megarlhf.models.transformer_config import DTYPES, RECOMPUTE
from megarlhf.ppo.algorithms import ALGORITHMS, PRESETS, AlgorithmOptions, resolve
from megarlhf.ppo.remote_reward import url_problem
from megarlhf.rewards.judge import JudgeConfig
from megarlhf.rl import AGGREGATION_MODES, KL_ESTIMATORS
from megarlhf.rl.correction import CORRECTION_LEVELS, CORRECTIONS
from megarlhf.rl.losses import POLICY_LOSSES, RATIO_LEVELS

KL_IN = ("reward", "loss")
ROLLOUT_BACKENDS = ("megatron", "vllm")
TEACHER_BACKENDS = ("megatron", "vllm")
NAN_POLICIES = ("stop", "skip")
OLD_LOGPROBS = ("auto", "experience_pass")
REWARD_URL_FORMATS = ("native", "openrlhf")
WORKER_GROUPS = ("local", "ray")
PLACEMENTS = ("colocated", "disaggregated")
SYNC_MODES = ("full", "delta")
ROLLOUT_MODES = ("sync", "one_step_off", "fully_async")
STALE_GROUPS = ("wait", "drop")
LAYER_SPECS = ("auto", "local", "sdpa")
"""Megatron layer specs of every role and of the Megatron rollout engine (models/specs.py;
'te' is refused there: TE_REFUSED)."""
PROMPT_FIELDS = KIND_FIELDS["prompt"] + OPTIONAL_FIELDS["prompt"]
RESUME_INPUTS = ("actor", "actor_adapter", "critic", "reward_model", "reward_judge", "teacher",
                 "teacher_by_source", "prompts", "seed", "algorithm")
EPISODE_FIELDS = {"env_args": {}, "max_turns": 8, "max_turn_tokens": None,
                  "max_observation_tokens": None, "on_env_error": "stop", "tools": (),
                  "tool_parser": "hermes", "tool_timeout": 30.0, "tool_workers": 2,
                  "tool_memory_mb": 1024, "tool_python_workers": None,
                  "tool_python_packages": (), "env_workers": 32}
"""The fields that only an environment reads, with their defaults."""
AGENT_READS = ("max_turns", "tool_parser")
"""Of EPISODE_FIELDS, those an agent's episodes read too (calls per episode, how tool calls
are found in its answers)."""
AGENT_FIELDS = {"agent_timeout": 600.0, "agent_max_requests": None}
"""The fields that only an agent reads, with their defaults."""
"""What a resumed run must share with its checkpoint, unless named in resume_allow_changes."""


_RANGES = (  # (field, low, high, low included?); high is included, values must be finite
    ("temperature", 0.0, math.inf, True),  # 0: greedy
    ("max_tokens_per_micro_batch", 1, math.inf, True),
    ("top_p", 0.0, 1.0, False),
    ("top_k", 0, math.inf, True),
    ("clip_eps", 0.0, 1.0, False),  # 1: no lower clip bound
    ("clip_eps_high", 0.0, math.inf, False),
    ("dual_clip", 1.0, math.inf, False),
    ("kl_clamp", 0.0, math.inf, False),
    ("log_ratio_clamp", 0.0, math.inf, False),
    ("aggregation_norm", 0, math.inf, False),
    ("overlong_buffer", 0, math.inf, True),
    ("overlong_penalty", 0.0, math.inf, True),
    ("dynamic_sampling_rounds", 0, math.inf, True),
    ("rollout_correction_threshold", 1.0, math.inf, False),
    ("value_clip_eps", 0.0, math.inf, False),
    ("entropy_coef", 0.0, math.inf, True),
    ("kl_coef", 0.0, math.inf, True),
    ("distill_coef", 0.0, math.inf, True),
    ("distill_clip", 0.0, math.inf, False),
    ("kl_target", 0.0, math.inf, False),
    ("kl_horizon", 1, math.inf, True),
    ("clip_reward", 0.0, math.inf, False),
    ("gamma", 0.0, 1.0, True),
    ("lam", 0.0, 1.0, True),
    ("actor_lr", 0.0, math.inf, False),
    ("critic_lr", 0.0, math.inf, False),
    ("seed", 0, 2**31 - 1, True),
    ("save_every", 0, math.inf, True),
    ("max_restarts", 0, math.inf, True),
    ("restart_window_steps", 1, math.inf, True),
    ("restart_backoff", 0.0, math.inf, True),
    ("restart_wait_s", 0.0, math.inf, False),
    ("max_engine_restarts", 0, math.inf, True),
    ("teacher_nproc", 1, math.inf, True),
    ("collective_timeout_s", 0.0, math.inf, False),
    ("phase_timeout_factor", 1.0, math.inf, False),
    ("phase_timeout_min_s", 0.0, math.inf, False),
    ("reward_timeout", 0.0, math.inf, False),
    ("tool_timeout", 0.0, math.inf, False),
    ("agent_timeout", 0.0, math.inf, False),
    ("agent_max_requests", 1, math.inf, True),
    ("max_failed_reward_fraction", 0.0, 1.0, True),
    ("delta_full_every", 1, math.inf, True),
    ("max_staleness", 0, math.inf, True),
    ("partial_rollout_tokens", 0, math.inf, True),
)


@dataclasses.dataclass(frozen=True)
class RolloutLayout:
    tensor_parallel: int | None = None
    """Ranks per rollout engine (consecutive ranks form one). None: the actor's
    tensor_parallel for the colocated Megatron backend (it runs in the actor's layout),
    else 1. See `PPOConfig.rollout_tp`."""


@dataclasses.dataclass(frozen=True)
class JudgeLayout:
    tensor_parallel: int | None = None
    """Ranks per judge engine (reward_judge). None: colocated, the actor's tensor_parallel
    for a Megatron judge (it runs in the actor's layout, which it must then keep) and the
    vLLM rollout engines' size for a vLLM judge (one vLLM parallel state per rank; 1 beside
    Megatron rollouts); disaggregated, 1."""


@dataclasses.dataclass(frozen=True)
class RoleLayout(LayoutOverride):
    """A model role's layout in the `layout` section: the mesh fields (expert_parallel and
    expert_tensor_parallel for a mixture-of-experts model), sequence parallelism, and
    activation recomputation (a trained role's backward: layout.reference.recompute and
    layout.reward.recompute may only be 'none', those models are frozen)."""

    recompute: str | None = None
    """Activation recomputation of a trained role: none, full or selective (None: the
    run's `recompute`)."""
    lora: LoraConfig | None = None
    """A trained role (actor, critic): LoRA adapters on its linear layers instead of training
    every weight, its checkpoint the frozen base (a critic's value head trains too). With an
    actor's adapters the reference is the actor with them switched off, in the actor's own
    ranks (no reference copy is loaded; disaggregated, the reference runs in the actor's
    group), unless they start from a PEFT adapter (lora.from_peft): then the reference is a
    frozen model of its own, the base with that adapter. The weight sync sends
    W + scale * B @ A, merged one tensor at a time."""


REWARD_KINDS = ("math", "exact_match", "fn", "url", "reward_model", "judge")
"""A reward term's kinds: a built-in checker by name, a function, the reward service, the
reward model, the judge."""
RESERVED_REWARD_NAMES = ("mean", "std", "timeouts", "worker_restarts", "overlong_penalty",
                         "url_failed_samples", "url_retries", "url_seconds",
                         "judge_parse_failures", "judge_score", "judge_seconds",
                         "judge_verdict_mass")
"""reward/<name> metrics the run logs itself: no term may take their names."""


@dataclasses.dataclass(frozen=True)
class RewardTerm:
    """One term of `rewards`: the step's score of a sample is the weighted sum of its terms,
    each logged as reward/<name> (its mean over the step's samples, before the weight)."""

    name: str
    """Names its metric, reward/<name>."""
    kind: str
    """math | exact_match (built-in checkers against the row's ground_truth), fn (`function`),
    url (the run's reward_url and its reward_url_* settings), reward_model (the run's
    reward_model checkpoint), judge (the run's reward_judge)."""
    weight: float = 1.0
    """Its factor in the sum (any finite number; negative penalises)."""
    function: str | None = None
    """kind fn: 'module:function', called as reward_fn's are."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """The per-role layout section. A model role's fields left unset take the run's
    top-level tensor_parallel / pipeline_parallel / context_parallel / expert_parallel /
    expert_tensor_parallel. Roles that share ranks (every role when colocated; reference and
    reward when disaggregated) must resolve to one layout."""

    actor: RoleLayout = dataclasses.field(default_factory=RoleLayout)
    """The actor's layout and adapters."""
    critic: RoleLayout = dataclasses.field(default_factory=RoleLayout)
    """The critic's layout and adapters."""
    reference: RoleLayout = dataclasses.field(default_factory=RoleLayout)
    """The reference model's layout (frozen: no adapters, no recomputation)."""
    reward: RoleLayout = dataclasses.field(default_factory=RoleLayout)
    """The reward model's layout (frozen: no adapters, no recomputation)."""
    rollout: RolloutLayout = dataclasses.field(default_factory=RolloutLayout)
    """The rollout engines' size."""
    judge: JudgeLayout = dataclasses.field(default_factory=JudgeLayout)
    """The judge engines' size (reward_judge)."""
    teacher: RoleLayout = dataclasses.field(default_factory=RoleLayout)
    """The teachers' layout on ranks of their own (teacher_nproc): tensor_parallel,
    pipeline_parallel and sequence parallelism (frozen: no adapters, no recomputation); with
    teacher_backend=vllm only tensor_parallel matters (the ranks of each vLLM engine).
    Without teacher_nproc the teachers run in the actor's group, in its layout: leave it
    unset."""


_RUN_REWARDS = (("url", "reward_url"), ("reward_model", "reward_model"),
                ("judge", "reward_judge"))
"""Reward kinds the run has at most one of, and the field that sets it up."""

LAYOUT_KEYS = {"actor": "actor", "ref": "reference", "critic": "critic", "reward": "reward",
               "teacher": "teacher"}
"""Model role -> its key in the `layout` section (every teacher's: "teacher")."""
TRAINED_ROLES = ("actor", "critic")
"""The model roles with an optimizer (the others are frozen: forward passes only)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class PPOConfig:
    # Keys recipes may still hold from earlier releases -> the fix, refused with it by
    # configio.from_dict (before any rank starts) rather than as unknown keys.
    RETIRED: ClassVar[dict[str, str]] = {
        "async_rollout": "set rollout_mode: one_step_off (or sync)",
        "reward_max_timeout_fraction": "a sample without a score is masked now; "
                                       "max_failed_reward_fraction bounds their share"}
    # -- models (Megatron checkpoints; tools/convert_hf makes them from HF) --
    actor: str
    """Policy checkpoint; also the frozen reference model."""
    critic: str | None = None
    """Value-model checkpoint; required by 'ppo', unused by the critic-free algorithms."""
    reward_model: str | None = None
    """Reward-model checkpoint (score at the last token)."""
    reward_fn: str | None = None
    """A built-in by bare name (`math`: the final answer, \\boxed{} or last number, against the
    row's ground_truth; `exact_match`) or 'module:function', added to the reward model's score.
    A user function is called as its signature says (megarlhf/rewards/calls.py): batched on
    text (a `responses` parameter; gets prompts, responses, ground_truths, data_sources and
    every other dataset column), verl's compute_score(data_source, solution_str, ground_truth,
    extra_info), or (prompt_ids, response_ids) -> float."""
    reward_fn_by_source: dict[str, str] = dataclasses.field(default_factory=dict)
    """data_source -> reward function (as reward_fn) for the rows of that source; other rows
    get reward_fn."""
    reward_workers: int = 2
    """Worker processes that run reward-function calls (a batch is split among them)."""
    reward_timeout: float = 60.0
    """Seconds one reward-function call may take; a call past it gives its samples no score
    (masked, as every failed score) and is counted in reward/timeouts."""
    max_failed_reward_fraction: float = 0.05
    """A sample whose score could not be computed (a reward_fn call that timed out, a
    reward_url batch that failed every retry, a judge verdict that could not be read, an
    episode dropped by on_env_error=drop) is masked: no loss, no value target, no part in any
    statistic or group baseline; a group estimator's group left with fewer than two scored
    samples is masked whole. Counted in reward/failed_samples and reward/failed_groups. A step
    (or validation) where more than this share of the samples failed stops the run, naming
    the source and its last error."""
    reward_url: str | None = None
    """An HTTP(S) endpoint that scores samples (megarlhf/ppo/remote_reward.py): each step's
    samples are POSTed as JSON in batches; its scores are added to the other rewards' (and
    score validation). Requests time out after reward_timeout seconds."""
    reward_url_format: str = "native"
    """native: lists of prompts, responses, ground_truths, data_sources, prompt_ids,
    response_ids and every dataset column in, {"scores": [...], <metric>: [...]} out;
    openrlhf: OpenRLHF's remote reward model, query/prompts/labels in, {"rewards": [...]}
    out (texts: needs a tokenizer)."""
    reward_url_batch_size: int = 64
    """Samples per request."""
    reward_url_concurrency: int = 4
    """Requests in flight at once."""
    reward_url_retries: int = 3
    """Retries of a request that timed out, could not connect or got a 429 / 5xx answer
    (waits of 0.5 s, doubling); a batch that still fails scores 0, counted in
    reward/url_failed_samples."""
    reward_url_headers_env: str | None = None
    """Name of an environment variable holding the requests' extra headers as a JSON object
    (e.g. an Authorization token); read in the launching process, never logged."""
    rewards: tuple[RewardTerm, ...] = ()
    """Named, weighted reward terms, e.g. [{name: correct, kind: math}, {name: style, kind:
    fn, function: my.rewards:style, weight: 0.5}, {name: rm, kind: reward_model, weight:
    0.1}]: a sample's score is the weighted sum, each term logged as reward/<name>. Empty:
    the reward model's, reward_fn's (reward_fn_by_source's) and reward_url's scores are
    added with weight 1, unnamed."""
    reward_judge: JudgeConfig | None = None
    """A generative judge (megarlhf/rewards/judge.py): a language model reads each training
    sample through a prompt template and its verdict is scored, e.g. {model: HF_DIR,
    template: judge.txt, verdict: yes_no}. Colocated, it runs on the rollout ranks beside the
    actor's engine (a Megatron judge at the actor's TP, PP/CP/EP 1; a vLLM one at
    layout.judge.tensor_parallel); disaggregated, on judge_nproc ranks of its own, scoring
    beside the other groups' work in the asynchronous rollout modes. Validation does not
    consult it."""
    reward_url_check: bool = True
    """Refuse the run before any rank starts when the reward server accepts no connection;
    false for a server that starts after the trainer (its first step then waits on the
    retries)."""
    teacher: str | None = None
    """On-policy distillation's teacher: an HF model directory (config.json and safetensors,
    its tensors streamed into the role's model at launch, as reward_judge.model's are; no
    conversion on disk) or a megarlhf checkpoint of a language model without LoRA adapters
    (mcore_to_hf exports a LoRA checkpoint merged), that shares the actor's tokenizer (its
    vocabulary and special tokens, checked before launch where its tokenizer files are
    found). With teacher_by_source it scores the rows of every source that map does not
    name. A frozen role of the experience pass in the actor's layout, beside the reference
    (offloaded outside experience with offload_params), or disaggregated on teacher_nproc
    ranks of its own at layout.teacher's (run at TP2 beside an actor at TP1, a checkpoint
    teacher with an HF-directory one per source), scoring every sampled response
    token (an episode's whole transcript is its context; only the model's tokens get a
    term). Read by algorithm=opd (a reward there is logged, not trained on; a sample whose
    reward failed is not trained, as everywhere) and by any other algorithm with
    distill_coef > 0, beside its rewards. Run end to end: opd colocated at TP2 + SP x DP2
    and at TP2 (an HF-directory teacher beside a per-source checkpoint one); GRPO with a
    reward function, and opd, on multi-turn episodes; disaggregated (in the actor's group)
    at TP1 x PP2 with a token budget and packing under fully_async (an HF-directory
    teacher), and one_step_off with vLLM rollouts, bf16, a LoRA actor and
    rollout_correction=tis. Refused before launch: a reward model or judge beside a
    teacher, context or expert parallelism, fp16."""
    teacher_by_source: dict[str, str] = dataclasses.field(default_factory=dict)
    """data_source -> teacher (as `teacher`: an HF directory or a checkpoint) for the rows of
    that source, as reward_fn_by_source maps reward functions: a student distilled from
    several domain teachers. Rows of the other sources get `teacher`; without one, a
    training prompt whose source is unmapped is refused before launch (no row trains on a
    term no teacher scored). Each distinct teacher is a frozen role of its own (its own
    weights on every rank of the group that runs the teachers, offloaded outside experience
    with offload_params when colocated, counted by the planner, a resume input), held to
    the same checks as `teacher`; each scores the whole batch in the experience pass and a
    row keeps its own teacher's logprobs, so k teachers cost k forward passes per step."""
    teacher_backend: str = "megatron"
    """What scores the teachers: 'megatron' (a frozen model role, wherever the teachers run)
    or 'vllm' (on teacher_nproc ranks of their own: vLLM engines of layout.teacher's
    tensor_parallel ranks, each teacher an engine reading its HF directory, scoring the
    given ids as prompt logprobs of raw logits; a checkpoint teacher must be exported with
    mcore_to_hf first). Run end to end: vllm at TP2 on 2 ranks with a per-source teacher,
    logprobs within 1e-4 of transformers' in fp32."""
    # -- data and output --
    prompts: str
    """Prompt dataset: a JSONL or Parquet file, or a directory written by HF datasets'
    save_to_disk. A row holds `prompt` (text, or a list of {role, content} messages) or
    `messages`, optionally `ground_truth`, `data_source` and any other fields (passed to the
    reward function); or `prompt_ids` (already tokenized). Text is rendered with the
    tokenizer's chat template (see template) and tokenized before any rank starts."""
    prompts_split: str | None = None
    """Split of an HF DatasetDict directory (None: its only split, or 'train')."""
    prompt_fields: dict[str, str] = dataclasses.field(default_factory=dict)
    """Where a row keeps each field, as a column or a dotted path into one: e.g.
    {prompt: question, ground_truth: reward_model.ground_truth} (verl's layout). Fields:
    prompt, ground_truth, data_source."""
    val_prompts: str | None = None
    """Held-out prompts (same forms and prompt_fields as prompts) for validation: greedy
    answers scored before the first step, every val_every steps and after the last."""
    val_prompts_split: str | None = None
    """The split of a val_prompts dataset directory (as prompts_split)."""
    val_every: int = 0
    """Validate every N steps (0: only before the first and after the last step)."""
    val_samples: int = 0
    """Also sample this many answers per validation prompt (at temperature) for pass@k;
    0: greedy only."""
    log_samples: int = 4
    """Prompt / response / reward samples per step written to samples.jsonl (and the
    dashboards)."""
    tokenizer: str | None = None
    """HF tokenizer directory (or SentencePiece .model) for text prompts and text rewards.
    None: the actor checkpoint's (its hf/ directory), else vllm_model_dir's."""
    template: str = "auto"
    """How text prompts are rendered: 'chat' (the tokenizer's chat template, with the
    generation prompt), 'plain' (' Human: ... Assistant:', as SFT's plain format), 'auto'
    (chat when the tokenizer has a template)."""
    on_bad_record: str = "error"
    """A prompt row that cannot be read: 'error' stops, 'skip' drops and counts it."""
    out_dir: str
    """Where the run writes: checkpoints, metrics.jsonl, samples.jsonl, the dashboards;
    a resumed run continues from its latest checkpoint."""
    # -- layout --
    nproc: int = 1
    """Ranks of a model group (TP x PP x CP x DP = nproc): colocated, every role shares them;
    disaggregated, actor, critic and ref+reward get nproc ranks each."""
    tensor_parallel: int = 1
    """Tensor-parallel ranks of every model role (unless `layout` sets the role's)."""
    pipeline_parallel: int = 1
    """Pipeline stages of every model role (unless `layout` sets the role's)."""
    context_parallel: int = 1
    """The layout of every model role (TP x PP x CP x DP = nproc), unless `layout` sets a
    role's. Context parallelism splits every sequence over CP ranks (long responses); the
    token budget and batch widths then round to multiples of 2 x CP."""
    expert_parallel: int = 1
    """Mixture-of-experts models: ranks that split each layer's experts (EP x
    expert_tensor_parallel must divide TP x CP x DP; no extra ranks), unless `layout` sets a
    role's."""
    expert_tensor_parallel: int | None = None
    """Ranks that split each expert's matrices; unset: 1 with expert_parallel > 1, else TP."""
    sequence_parallel: bool = False
    """Sequence parallelism in every model role (activations outside attention and MLP split
    over the TP ranks; needs tensor_parallel > 1), unless `layout` sets a role's. The
    colocated Megatron rollout engine generates without it from the same weights."""
    recompute: str = "none"
    """Activation recomputation in the trained roles' (actor, critic) backward, unless
    `layout` sets a role's: 'none'; 'full' (each layer keeps only its input and runs again in
    backward); 'selective' (attention's core recomputed, megatron-core's selective
    granularity). The frozen ref and reward models run forward only: nothing to recompute."""
    layout: Layout = dataclasses.field(default_factory=Layout)
    """Per-role layouts over the fields above: `layout.critic.tensor_parallel=4`,
    `layout.actor.recompute=full`, ...; `layout.rollout.tensor_parallel` sizes the rollout
    engines."""
    # -- memory between phases (colocated placement; megarlhf/ppo/residency.py) --
    offload_params: bool = False
    """Move the weights of roles a phase does not use off the device (to pinned host memory),
    and back when a phase needs them: the ref and reward models outside experience, the
    actor and critic outside experience, train and (actor) the weight sync."""
    offload_grads: bool = False
    """Free the actor's and critic's gradient buffers outside train (they are zeroed at the
    start of every step, so nothing is copied)."""
    offload_optimizer: bool = False
    """Move the actor's and critic's optimizer states (Adam moments, fp32 master weights)
    off the device outside train."""
    rollout_sleep: bool = False
    """Put the rollout engines to sleep after the step's rollouts (weights and KV cache
    freed) and wake them in stages at the weight sync: weights, the sync, then the KV
    cache."""
    worker_group: str = "local"
    """'local' (processes on this machine) or 'ray' (one Ray actor per rank)."""
    placement: str = "colocated"
    """'colocated': all roles and the rollout engine on the same nproc ranks;
    'disaggregated': a group of ranks per role, each its own torch.distributed world, the
    independent work of a phase running concurrently (see ppo/placement.py)."""
    rollout_nproc: int = 1
    """Disaggregated only: rollout ranks, in engines of rollout_tp ranks, fed by the actor's
    ranks."""
    judge_nproc: int = 1
    """Disaggregated only, with reward_judge: the judge's ranks (a group of their own), in
    engines of layout.judge.tensor_parallel ranks; a step's judge prompts are dealt over the
    engines."""
    teacher_nproc: int | None = None
    """Disaggregated only, with a teacher: the teachers' ranks, a group of their own
    ("teacher") holding every teacher of the run (teacher_by_source's too) at
    layout.teacher's tensor_parallel x pipeline_parallel (its DP: teacher_nproc / (TP x
    PP)), scoring in the experience pass beside the other groups. None: the teachers run in
    the actor's group, in its layout."""
    sync_mode: str = "full"
    """Disaggregated only: how the actor's weights travel to the rollout ranks. 'full':
    every bucket whole; 'delta': per bucket, only the elements whose bits changed since the
    last sync (or the whole bucket where that is not smaller), patched into the bucket each
    side keeps in host memory (a copy of the model per rollout rank and per sending rank),
    checked against the trainer's CRC-32. Pays in bf16, where most elements keep their bits
    between steps; in fp32 nearly all change."""
    delta_full_every: int = 20
    """sync_mode=delta: the weights of every step that is a multiple of this sync whole (and
    the first sync of each start); the other steps' as deltas."""
    rollout_mode: str | None = None
    """When the rollout engines sample, relative to training. 'sync': each step's samples
    after the step before synced its weights. 'one_step_off' (disaggregated): step n+1's
    while step n trains, so the engine's weights are one update behind the actor's when it
    samples (each step logs rollout/weight_version and rollout/policy_lag); needs a
    rollout_correction to weigh that gap. 'fully_async' (disaggregated): the engines generate
    without waiting into a buffer of finished groups; each step takes its groups from it,
    oldest weights first (ppo/streaming.py). No sample trains more than max_staleness
    weight versions old: the engines pause rather than start groups that would, and a group
    that finishes late is waited for or dropped (stale_groups). None: 'sync'."""
    max_staleness: int = 1
    """rollout_mode=fully_async: the most weight updates a trained sample's oldest token may
    lag the actor by, a whole number (0 waits for each sync, as sync does)."""
    stale_groups: str = "wait"
    """rollout_mode=fully_async: what becomes of a group that finishes late (its long samples
    took more engine calls than the others') while younger groups fill the buffer. 'wait':
    each step trains the groups it is the last max_staleness allows, waiting for them if it
    must (time/staleness_wait), so long answers train as often as short ones. 'drop': steps
    take what finished first and drop a group once it would lag more (rollout/stale_dropped;
    rollout/stale_dropped_length_mean beside rollout/trained_length_mean shows the bias to
    short answers this costs)."""
    partial_rollout_tokens: int = 256
    """rollout_mode=fully_async: the new tokens a sample gets per engine call. A weight sync
    waits for the call in progress, then the unfinished samples continue under the new
    weights (their prefixes computed again), each token keeping the version it was sampled
    under (rollout/policy_lag_mean and _max are over tokens). 0: whole samples per call (a
    sync waits for the longest)."""
    dtype: str = "fp32"
    """Param dtype of every role and of the rollout engine: fp32, bf16 or fp16. 16-bit roles
    train with fp32 main grads and fp32 master weights (the distributed optimizer's). A
    checkpoint saved in another dtype is cast on load, so fp32 or bf16 conversions of an HF
    model train in any of them."""
    layer_spec: str = "auto"
    """Megatron layer spec of every role and of the Megatron rollout engine: auto (sdpa, on
    GPU and CPU: models/specs.py says why), local or sdpa."""
    # -- rollout --
    rollout_backend: str = "megatron"
    """megatron (the actor's own engine, no extra install) or vllm (vllm_model_dir)."""
    vllm_model_dir: str | None = None
    """HF directory with the actor's config.json (vLLM backend)."""
    rollout_max_model_len: int | None = None
    """vLLM engines: the longest prompt + response they serve. None: the longest prompt of the
    prompts file + max_new_tokens (never the model's full context)."""
    rollout_kv_cache_bytes: int | None = None
    """vLLM engines: KV-cache bytes on each engine rank. None: room for the engine's share of
    a step's samples at rollout_max_model_len, all at once (what `megarlhf plan` counts)."""
    rollout_gpu_memory_utilization: float | None = None
    """vLLM engines: size the KV cache as this fraction of device memory instead, for engines
    with a device of their own (next to a resident trainer a fraction is fragile; on CPU it
    is a fraction of all RAM). Excludes rollout_kv_cache_bytes."""
    rollout_cuda_graphs: bool = False
    """vLLM engines (rollout, judge and teachers): capture CUDA graphs for decoding (GPU: slower start,
    faster decode).
    False runs eagerly (CPU always does)."""
    routing_replay: bool = False
    """Mixture-of-experts actor: the rollout engine returns the experts it sent each token
    to, and the actor's logprob and update passes send the token to the same experts (its
    router still weighs them, so its gradients flow). A near-tie in the router then cannot
    put a token through other experts in the trainer than in sampling. The reference and
    critic route freely. Megatron rollout backend only: vLLM returns its routing only with
    its V2 model runner, which needs Triton (not on CPU); not verified here."""
    prompts_per_step: int = 8
    """Prompts drawn per step."""
    samples_per_prompt: int = 1
    """Responses sampled per prompt (the group of group estimators: >= 2)."""
    max_new_tokens: int = 16
    """Longest response (a multi-turn episode: all the model's turns together)."""
    temperature: float = 1.0
    """Sampling temperature of the rollouts."""
    top_p: float = 1.0
    """Nucleus sampling: the smallest set of tokens whose probability reaches top_p (1: all)."""
    top_k: int = 0
    """Sample among the k most likely tokens (0: all)."""
    stop_token_ids: tuple[int, ...] | None = None
    """Tokens that end a sample (kept as its last token). None: the actor's EOS ids, from the
    config, generation config and tokenizer files its checkpoint carries (a chat model's
    end-of-turn too); () never stops before max_new_tokens."""
    # -- multi-turn episodes (megarlhf/envs) --
    environment: str | None = None
    """Train on multi-turn episodes: the environment that answers the model's turns, a
    built-in (`tools`; `arithmetic_retry`) or 'module:Class' (a megarlhf.envs.Environment).
    A sample is then an episode: the model's turns and the environment's observations
    between them, only the model's tokens trained on. None: one answer per sample."""
    env_args: dict = dataclasses.field(default_factory=dict)
    """Keyword arguments the environment is constructed with (one instance per episode)."""
    max_turns: int = 8
    """Model turns per episode, at most."""
    max_turn_tokens: int | None = None
    """New tokens of one model turn, at most (None: max_new_tokens). max_new_tokens bounds
    the whole episode after the prompt: an episode ends when its next observation would
    leave no room for a model token, and a turn takes at most what is left."""
    max_observation_tokens: int | None = None
    """An observation (the environment's messages with their template tokens) longer than
    this is cut, its text shortened, and counted (env/observations_cut). None:
    max_new_tokens."""
    on_env_error: str = "stop"
    """An environment that raises in reset or step: 'stop' the run naming it, the row and
    the turn; 'drop' ends that episode and masks it as a failed score (env/errors,
    reward/failed_samples; max_failed_reward_fraction bounds their share)."""
    tools: tuple[str, ...] = ()
    """environment=tools: the functions the model may call, 'module:function' each (type
    hints and a docstring Args: section give its JSON schema), or `python` (the built-in
    sandboxed interpreter)."""
    tool_parser: str = "hermes"
    """How tool calls are found in a turn: 'hermes' (<tool_call>{"name", "arguments"}
    </tool_call>, Qwen2.5/Qwen3/Hermes), 'llama3_json' ({"name", "parameters"}), or
    'module:function' (text -> [{"name", "arguments"}, ...])."""
    tool_timeout: float = 30.0
    """Seconds a tool call may take (the python tool's CPU and wall time too); a call past it
    is answered with an error message."""
    tool_workers: int = 2
    """Worker processes that run tool functions (calls of a turn run in parallel)."""
    tool_memory_mb: int = 1024
    """The python tool's address-space limit."""
    tool_python_workers: int | None = None
    """The most python tool calls that run at once (each a sandboxed interpreter; the others
    wait their turn). None: this machine's CPU cores."""
    tool_python_packages: tuple[str, ...] = ()
    """Directories of Python packages the python tool's code may import (read-only, on its
    PYTHONPATH); it sees no other site-packages."""
    env_workers: int = 32
    """Threads that run the reset() and step() of environments written as plain functions,
    so that episodes waiting on I/O overlap (an async environment runs on the event loop
    and needs none)."""
    agent: str | None = None
    """Train an agent program written against an OpenAI-style client instead of an
    environment: 'module:function', an async function called per episode as
    `await function(base_url=..., api_key=..., model=..., row=row)` (row: the prompt row).
    base_url is an OpenAI-compatible endpoint (/v1/chat/completions, /v1/completions,
    /v1/models) the run serves on loopback from its rollout engines, api_key names the
    episode. It returns the episode's reward (a finite number, added to what the run's reward
    sources score) or None (they score the final conversation). Each episode is one
    token-exact row (the calls that extend one another, the model's tokens as sampled,
    everything else masked; see megarlhf/envs/agents.py); max_turns bounds its calls,
    max_new_tokens its tokens after the prompt, tool_parser reads tool calls in answers to
    requests with tools. The run's sampling settings apply to every call. An episode whose
    program raises, times out or returns something else is masked and counted
    (agent/errors)."""
    agent_timeout: float = 600.0
    """Seconds an agent's episode may run; past it the episode fails (masked, counted)."""
    agent_max_requests: int | None = None
    """Requests the agent endpoint serves at once; more are answered 429 (the openai client
    retries them). None: twice the most episodes that run at once (a step's rows, or the
    validation prompts)."""
    chat_template: str | None = None
    """A Jinja chat template file used instead of the tokenizer's for prompts and
    observations (e.g. one that renders earlier turns unchanged where the model's own does
    not)."""
    # -- algorithm --
    algorithm: str = "ppo"
    """ppo, grpo, rloo, reinforce++, reinforce++_baseline, dapo, dr_grpo, gspo, cispo or opd
    (on-policy distillation from `teacher`, no reward needed): an advantage estimator, and
    the value of every option below that says "(algorithm's)" while it is unset
    (megarlhf/ppo/algorithms.py; the table in docs/guides/algorithms.md)."""
    steps: int = 10
    """Steps of the run (rollout, experience, updates, weight sync)."""
    ppo_epochs: int = 1
    """Passes over a step's rollout batch."""
    mini_batches: int = 1
    """Optimizer steps per epoch (the rollout batch is cut into this many parts)."""
    old_logprobs: str = "auto"
    """Where the actor's "old" logprobs (the importance ratio's denominator) come from.
    'auto': from the update pass itself (detached) when they cannot differ from a separate
    pass (`one_pass_old_logprobs`), which saves the actor's experience forward; otherwise, and
    always with 'experience_pass', from a forward over the batch before training."""
    micro_batches: int = 1
    """Micro-batches per mini-batch and DP rank (pipeline schedule)."""
    max_tokens_per_micro_batch: int | None = None
    """Instead of micro_batches equal parts: every role cuts a batch into micro-batches of at
    most this many model tokens (rows x columns padded, the packed length packed), its rows
    spread over the DP ranks by token count, not row count (megarlhf/roles/batching.py).
    Must hold the longest prompt + max_new_tokens."""
    pack_sequences: bool = False
    """Pack each token-budget micro-batch's sequences into one row, each attending only to
    itself, instead of padding them to the longest: no compute on padding."""
    share_prompts: bool = True
    """Samples of one prompt in a micro-batch run the prompt once: one model row holds it
    and each sample's response after it, every response attending to the prompt and to
    itself (roles/batching.py), with the outputs of separate rows up to summation order. n
    samples of a P-token prompt then cost about P + n x response positions instead of n x
    (P + response), in every role's forward and backward, where that keeps no more
    activations than a row per sample. Under max_tokens_per_micro_batch the budget counts
    the shared layout's positions (a prompt once per model row) and a prompt's samples stay
    in one micro-batch where the budget allows. Packed rows (pack_sequences), context
    parallelism and mixture-of-experts models keep one row per sample."""
    clip_eps: float | None = None
    """(algorithm's) Lower clip range of the importance ratio: 1 - clip_eps."""
    clip_eps_high: float | None = None
    """(algorithm's) Upper clip range: 1 + clip_eps_high (DAPO's clip-higher); the
    algorithm's, else clip_eps."""
    dual_clip: float | None = None
    """Dual-clip constant (> 1) capping the loss of negative advantages; None: off."""
    ratio_level: str | None = None
    """(algorithm's) 'token' importance ratios, or 'sequence' (GSPO: the exp of a row's mean
    token log-ratio)."""
    policy_loss: str | None = None
    """(algorithm's) 'clip' (PPO's clipped surrogate) or 'cispo' (clipped stop-gradient
    weights on the REINFORCE term: every token keeps a gradient)."""
    aggregation: str | None = None
    """(algorithm's) token_mean, seq_mean_token_mean, seq_mean_token_sum or
    seq_mean_token_sum_norm (megarlhf/rl/losses.py)."""
    aggregation_norm: int | None = None
    """seq_mean_token_sum_norm's constant in tokens (None: max_new_tokens)."""
    advantage_std_norm: bool | None = None
    """(algorithm's) GRPO-style estimators: divide by the group's reward std."""
    whiten_advantages: bool | None = None
    """(algorithm's) Whiten the advantages over the batch once more (ppo's GAE: yes; group
    estimators: no). REINFORCE++ whitens inside its estimator and refuses this field."""
    value_clip_eps: float = 0.2
    """The critic's value clip around the old values."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus in the actor's loss (0: none)."""
    kl_coef: float | None = None
    """(algorithm's) KL(actor || reference) coefficient: in the reward or the loss (kl_in);
    the adaptive controller's start value with kl_target."""
    kl_in: str | None = None
    """(algorithm's) 'reward': a per-token penalty in the reward (PPO, RLOO, REINFORCE++);
    'loss': a term of the actor's loss, logged as actor/kl_loss (GRPO)."""
    kl_estimator: str | None = None
    """(algorithm's) k1, k2 or k3 (megarlhf/rl/kl.py)."""
    distill_coef: float | None = None
    """(algorithm's: opd 1, the others 0) Weight of on-policy distillation's per-token term,
    distill_coef x (teacher logprob - the actor's old logprob) of each sampled token, added
    to the advantages after the algorithm's own normalisation and whitening (needs teacher),
    on the tokens trained only (never an episode's observations, nor a sample without a
    score); logged over the same tokens as distill/reverse_kl and
    distill/teacher_logprob_mean."""
    distill_clip: float | None = None
    """Bound on the distillation term of one token: clamped to [-distill_clip, distill_clip]
    (None: unbounded)."""
    kl_clamp: float | None = 10.0
    """Clamp on each token's KL estimate (None: none)."""
    log_ratio_clamp: float | None = 20.0
    """Clamp on the log importance ratio before exp (None: none)."""
    kl_target: float | None = None
    """Adaptive KL controller's target (None: fixed kl_coef)."""
    kl_horizon: int = 10000
    """Adaptive KL controller's horizon, in samples."""
    clip_reward: float | None = None
    """Clip each sample's score to [-clip_reward, clip_reward] (None: no clip)."""
    gamma: float = 1.0
    """GAE's discount."""
    lam: float = 0.95
    """GAE's lambda."""
    dynamic_sampling: bool | None = None
    """(algorithm's) Train only on prompts whose samples' rewards differ (DAPO): groups of
    equal rewards are dropped and more prompts generated to replace them."""
    dynamic_sampling_rounds: int = 4
    """Extra generation rounds one step may take to replace dropped groups; when they run
    out, the batch is completed with dropped groups (their group advantages are 0, unless an
    in-reward KL or whitening adds some) and rollout/dynamic_sampling_short counts them."""
    overlong_buffer: int | None = None
    """(algorithm's) DAPO's soft overlong penalty: responses longer than max_new_tokens -
    overlong_buffer lose up to overlong_penalty, linearly (0: off)."""
    overlong_penalty: float = 1.0
    """The largest overlong_buffer penalty (at max_new_tokens)."""
    rollout_correction: str = "none"
    """Reweight the policy gradient for the rollout engine's sampling distribution:
    'tis' truncates the weights pi_old / pi_engine at rollout_correction_threshold, 'mis'
    zeroes those outside [threshold_low, threshold]; 'none': no correction."""
    rollout_correction_level: str = "token"
    """'token' weights, or 'sequence' (the product over a row's tokens)."""
    rollout_correction_threshold: float = 2.0
    """TIS's truncation and MIS's upper bound of the weights pi_old / pi_engine."""
    rollout_correction_threshold_low: float | None = None
    """MIS's lower bound (None: 1 / rollout_correction_threshold)."""
    actor_lr: float = 1e-5
    """The actor's learning rate (Adam)."""
    critic_lr: float = 1e-5
    """The critic's learning rate (Adam)."""
    # -- run control --
    seed: int = 0
    """Seeds the prompt order and the sampling."""
    save_every: int = 0
    """Checkpoint every N steps (0: only at the end)."""
    keep_last: int = 2
    """Checkpoints kept in out_dir (older ones are removed once a newer one is complete)."""
    max_restarts: int = 2
    """When a rank dies (killed, OOM-killed; under Ray its actor died, also with its node) or
    hangs or loses a peer (a collective timed out or lost its peer, see collective_timeout_s;
    or a phase passed its deadline, see phase_timeout_factor), every group is torn down and
    started again from the latest checkpoint, up to this many times within
    restart_window_steps; each restart is a "restart" event in metrics.jsonl. Without a
    checkpoint yet (see save_every), once they are used up, or when the last restart's fault
    comes back in the same step, the run stops naming the fault (exit code 1). Any other
    exception a rank raises (a bug, bad input), and a local rank's own crash or abort, stop
    the run. Under Ray any death of a started actor counts as lost (Ray does not tell a
    kill from a crash; a crash that comes back in the same step stops the run), and the new
    actors go wherever the cluster has room (see restart_wait_s)."""
    restart_window_steps: int = 50
    """The steps max_restarts counts restarts over: a fault in step s stops the run if
    max_restarts restarts were made for faults in steps s - restart_window_steps + 1 to s,
    so the budget refills once the faults are that many steps apart (a long job may lose a
    rank now and then)."""
    restart_backoff: float = 5.0
    """Seconds to wait before a restart."""
    restart_wait_s: float = 600.0
    """Under Ray, how long a restart waits for the cluster to have room for the run's ranks
    (a node lost; an autoscaler may bring one back). Then the run stops with exit code 75,
    which launch/ppo.sbatch answers by requeueing the job: on a new allocation it resumes
    from its last checkpoint. A first start waits as long as it takes."""
    max_engine_restarts: int = 3
    """placement=disaggregated: when a rollout engine's rank dies or hangs while the engines
    generate, the rollout group alone is started again, given the actor's weights (a whole
    sync) and asked again, and the trainer's groups keep their state; up to this many times
    in a run (counted from its last whole restart), each an "engine_restart" event in
    metrics.jsonl and every later step carrying fault/engine_restarts. The same fault again
    in the call asked again stops the run. A loss the engines cannot get their weights back
    from (the actor trained since their last sync: one_step_off and fully_async, now and
    then), one during a weight sync, one past this count, any in a colocated group, and any
    under worker_group=ray or of a vLLM engine (neither tested) take the whole restart
    (max_restarts). 0: every loss takes the whole restart."""
    collective_timeout_s: float = 600.0
    """torch.distributed's timeout for the worker ranks' Megatron process groups and the
    weight channel (vLLM's own groups keep torch's defaults): how long a rank waits in a
    collective for a peer that never comes (hung, or stopped). Over gloo (CPU) the waiting
    rank then fails; over NCCL the watchdog aborts it (SIGABRT; the ranks run with
    TORCH_NCCL_ASYNC_ERROR_HANDLING=3). Either way the run restarts (max_restarts): a local
    rank's abort counts as the watchdog's when the call has run this long and a peer has
    not answered (else it is the rank's own and stops the run); under Ray its actor died.
    Keep it above the longest time a rank may legitimately wait for its peers (one rank
    writing a large checkpoint). It and the phase deadline (phase_timeout_factor) race for
    the same hang: whichever fires first restarts the run naming the hung phase, and both
    are the same fault for the same-step rule (max_restarts)."""
    phase_timeout_factor: float = 5.0
    """The controller's deadline for a phase (a call on the worker groups: rollout,
    experience, train, sync, save...) is this factor times the longest of the last 5
    durations of calls of the same method, roles and batch size, at least
    phase_timeout_min_s; a call of a size not seen yet has 30 minutes (the start-up, which
    loads every model, has 30 minutes with local worker groups and no limit under Ray).
    Past it the ranks that did not answer are named and the run restarts (max_restarts).
    With a deadline shorter than collective_timeout_s (short phases: phase_timeout_min_s)
    the deadline catches a hang first, else the ranks' collective timeout does."""
    phase_timeout_min_s: float = 300.0
    """The shortest phase deadline (see phase_timeout_factor)."""
    resume_allow_changes: tuple[str, ...] = ()
    """Inputs a resumed run may change on purpose (of RESUME_INPUTS: actor, actor_adapter
    (layout.actor.lora.from_peft: the reference's adapter), critic, reward_model,
    reward_judge (its model and template), teacher, teacher_by_source, prompts, seed,
    algorithm); any other
    difference from what the checkpoint in out_dir was trained with stops the run before it
    starts."""
    skip_overlong: bool = False
    """Drop prompts that do not fit the model's positions (or rollout_max_model_len) next to
    max_new_tokens, with a count, instead of refusing the prompts file."""
    logprob_gap_limit: float | None = None
    """Largest mean |engine - trainer| logprob gap per response token a step accepts. None:
    the dtype's default (rollout/gap.py: fp32 1e-3, bf16 and fp16 5e-2)."""
    logprob_gap_max_limit: float | None = None
    """Largest |engine - trainer| logprob gap of a single response token (catches a few
    corrupted tokens that leave the mean small): fp32 steps accept no token over it, 16-bit
    steps one in a thousand. None: the dtype's default (rollout/gap.py: fp32 5e-2, bf16 and
    fp16 2.0)."""
    logprob_gap_policy: str = "stop"
    """Above either limit: 'stop' the run before the step trains, or 'warn' and go on."""
    nan_policy: str = "stop"
    """Non-finite reward or loss: 'stop' the run, or 'skip' the step's update."""
    # -- dashboards (metrics.jsonl and the console always) --
    tensorboard: bool = False
    """Also write TensorBoard event files to out_dir/tensorboard (needs `tensorboard`)."""
    wandb_project: str | None = None
    """Also log to this W&B project (needs `wandb` and a login); a resumed job continues the
    same W&B run."""
    profile: bool = False
    """Profile the phases (rollout, experience, train, sync) of the steps in profile_steps on
    every rank: a Chrome trace per rank and phase in out_dir/profile/step_<N>/, and a table
    per phase (operator time by category, the top operators, time outside operators) printed
    and logged as a "profile" event in metrics.jsonl (megarlhf/profiling.py). On a GPU rank
    the table also splits the kernels' device time by category and the traces hold the
    kernels."""
    profile_steps: tuple[int, ...] | None = None
    """The steps `profile` profiles; None: every step the run takes."""

    def profiles(self, step: int) -> bool:
        """Whether `profile` covers step `step`."""
        return profiling.profiled(self.profile, self.profile_steps, step)

    def __post_init__(self):
        problems = []

        def choice(name, options):
            if getattr(self, name) not in options:
                problems.append(f"{name}={getattr(self, name)!r} is not one of {list(options)}")

        choice("algorithm", ALGORITHMS)
        choice("rollout_backend", ROLLOUT_BACKENDS)
        choice("teacher_backend", TEACHER_BACKENDS)
        choice("nan_policy", NAN_POLICIES)
        choice("logprob_gap_policy", GAP_POLICIES)
        choice("old_logprobs", OLD_LOGPROBS)
        choice("reward_url_format", REWARD_URL_FORMATS)
        for name in ("logprob_gap_limit", "logprob_gap_max_limit"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                problems.append(f"{name} must be > 0, got {getattr(self, name)}")
        choice("worker_group", WORKER_GROUPS)
        for name in self.resume_allow_changes:
            if name not in RESUME_INPUTS:
                problems.append(f"resume_allow_changes: {name!r} is not one of "
                                f"{list(RESUME_INPUTS)}")
        choice("placement", PLACEMENTS)
        choice("sync_mode", SYNC_MODES)
        for name, options in (("ratio_level", RATIO_LEVELS), ("policy_loss", POLICY_LOSSES),
                              ("aggregation", AGGREGATION_MODES), ("kl_in", KL_IN),
                              ("kl_estimator", KL_ESTIMATORS)):
            if getattr(self, name) is not None:  # None: the algorithm's
                choice(name, options)
        choice("rollout_correction", CORRECTIONS)
        choice("recompute", RECOMPUTE)
        choice("rollout_correction_level", CORRECTION_LEVELS)
        choice("dtype", DTYPES)
        if self.layer_spec == "te":
            problems.append(f"layer_spec='te': {TE_REFUSED}")
        else:
            choice("layer_spec", LAYER_SPECS)
        choice("template", TEMPLATES)
        choice("on_bad_record", BAD_RECORD_POLICIES)
        problems += self._data_problems()
        problems += self._episode_problems()
        problems += self._agent_problems()
        for name in ("nproc", "tensor_parallel", "pipeline_parallel", "context_parallel",
                     "expert_parallel",
                     "prompts_per_step",
                     "samples_per_prompt", "max_new_tokens", "steps", "ppo_epochs",
                     "mini_batches", "micro_batches", "keep_last", "rollout_nproc",
                     "judge_nproc", "reward_workers", "reward_url_batch_size",
                     "reward_url_concurrency"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        problems += self._range_problems()
        replica = self.tensor_parallel * self.pipeline_parallel * self.context_parallel
        if self.nproc % replica:
            problems.append(f"nproc={self.nproc} is not a multiple of tensor_parallel x "
                            f"pipeline_parallel x context_parallel = {replica}")
        problems += self._layout_problems()
        if self.sequence_parallel and not any(p.sequence_parallel for p in (
                *self._valid_layouts().values(), self._own_teacher_layout()) if p is not None):
            problems.append("sequence_parallel=true needs tensor_parallel > 1 (in the run's "
                            "or a role's layout)")
        if self.algorithm in ALGORITHMS:
            problems += self._algorithm_problems()
        if self.reward_url is not None and url_problem(self.reward_url):
            problems.append(url_problem(self.reward_url))
        if self.reward_url_retries < 0:
            problems.append(f"reward_url_retries must be >= 0, got {self.reward_url_retries}")
        if self.reward_url_headers_env is not None and self.reward_url is None:
            problems.append("reward_url_headers_env is set, but no reward_url")
        problems += self._reward_term_problems()
        problems += self._judge_problems()
        problems += self._teacher_group_problems()
        if not self.has_reward and self.algorithm != "opd":
            problems.append("no reward: set reward_model=CKPT and/or reward_fn=math|exact_match|"
                            "module:function, or an environment that gives rewards")
        if self.placement != "colocated":
            problems += [f"{name}=true applies to placement=colocated (a disaggregated group "
                         f"holds only the roles it runs, none idle); set it false"
                         for name in ("offload_params", "offload_grads", "offload_optimizer",
                                      "rollout_sleep") if getattr(self, name)]
        for role in TRAINED_ROLES:
            lora, key = self.lora_of(role), LAYOUT_KEYS[role]
            layout = self._valid_layouts().get(role)
            problem = lora and layout and layout_problem(lora, layout)
            if problem:
                problems.append(f"layout.{key}.lora: {problem}")
            if role == "critic" and lora is not None and lora.from_peft is not None:
                problems.append("layout.critic.lora.from_peft: a PEFT adapter is a language "
                                "model's; the critic's adapters start at zero over its value "
                                "model")
        if self.lora_of("actor") is not None and self.dtype != "fp32" \
                and self.rollout_correction == "none":
            # The sync merges W + scale * B @ A and rounds it to 16 bits: an adapter update
            # below half a 16-bit step of W reaches the trainer but not the engines
            # (docs/guides/lora.md: a mean gap of up to 0.045 on SmolLM2 in bf16).
            problems.append(f"layout.actor.lora with dtype={self.dtype}: the engines get the "
                            f"merged weights rounded to {self.dtype}, behind the trainer's "
                            f"adapters; set rollout_correction=tis (or mis), or dtype=fp32")
        problems += self._rollout_mode_problems()
        choice("stale_groups", STALE_GROUPS)  # read by fully_async only; a typo is one anyway
        if type(self.max_staleness) is not int:  # isinstance would let a bool through
            problems.append(f"max_staleness={self.max_staleness!r} must be a whole number of "
                            f"weight updates (0, 1, 2, ...)")
        if self.placement == "colocated" and self.sync_mode == "delta":
            problems.append(f"sync_mode={self.sync_mode} needs placement=disaggregated; a "
                            f"colocated sync copies the weights inside each rank")
        # Not run end to end yet (its channel protocol with several senders is tested).
        if self.sync_mode == "delta" and self._actor_layout().pipeline_parallel > 1:
            problems.append("sync_mode=delta is not tested with the actor's pipeline_parallel "
                            "> 1 yet; use sync_mode=full")
        if self.sync_mode == "delta" and self.worker_group == "ray":
            problems.append("sync_mode=delta is not tested under worker_group=ray yet; use "
                            "sync_mode=full or worker_group=local")
        if self.placement == "colocated" and self.rollout_nproc != 1:
            problems.append(f"rollout_nproc={self.rollout_nproc} needs "
                            f"placement=disaggregated; colocated rollouts run on the nproc "
                            f"training ranks")
        if (self.placement == "colocated" and self.rollout_backend == "megatron"
                and (self._actor_layout().pipeline_parallel > 1
                     or self._actor_layout().context_parallel > 1
                     or self._actor_layout().expert_parallel > 1)):
            problems.append("the colocated Megatron rollout backend runs at PP=1, CP=1 and "
                            "EP=1 (the actor's layout); use rollout_backend=vllm, or "
                            "placement=disaggregated, with pipeline_parallel, "
                            "context_parallel or expert_parallel > 1")
        if self.routing_replay and self.rollout_backend != "megatron":
            problems.append("routing_replay=true needs rollout_backend=megatron: vLLM returns "
                            "its expert routing only with its V2 model runner (Triton), which "
                            "megarlhf has not verified")
        if self.routing_replay and self.recompute_of("actor") == "full":
            problems.append("routing_replay=true with the actor's recompute=full: the "
                            "recomputed layers would route again in backward; use "
                            "recompute=selective or none")
        if self.rollout_backend == "vllm" and not self.vllm_model_dir:
            problems.append("rollout_backend=vllm needs vllm_model_dir (an HF dir with the "
                            "actor's config.json, e.g. its mcore_to_hf export)")
        problems += self._rollout_tp_problems()
        if self.rollout_max_model_len is not None and \
                self.rollout_max_model_len <= self.max_new_tokens:
            problems.append(f"rollout_max_model_len={self.rollout_max_model_len} leaves no room "
                            f"for a prompt next to max_new_tokens={self.max_new_tokens}")
        if self.rollout_kv_cache_bytes is not None and self.rollout_kv_cache_bytes <= 0:
            problems.append(f"rollout_kv_cache_bytes must be > 0, got "
                            f"{self.rollout_kv_cache_bytes}")
        fraction = self.rollout_gpu_memory_utilization
        if fraction is not None and not 0 < fraction <= 1:
            problems.append(f"rollout_gpu_memory_utilization must be in (0, 1], got {fraction}")
        if fraction is not None and self.rollout_kv_cache_bytes is not None:
            problems.append("set one of rollout_kv_cache_bytes and "
                            "rollout_gpu_memory_utilization, not both")
        rows = self.prompts_per_step * self.samples_per_prompt
        budget = self.max_tokens_per_micro_batch
        if self.pack_sequences and budget is None:
            problems.append("pack_sequences=true needs max_tokens_per_micro_batch (the "
                            "length of a packed row)")
        if budget is not None and self.micro_batches != 1:
            problems.append("max_tokens_per_micro_batch sets the number of micro-batches: "
                            "leave micro_batches at 1")
        spanning = sorted(role for role, p in self._valid_layouts().items()
                          if p.expert_group_size > p.tensor_parallel * p.context_parallel)
        if budget is not None and spanning:
            # An MoE forward is a collective over the expert group; with token budgets each
            # DP rank makes its own number and shapes of micro-batches (measured: a crash in
            # the dispatcher on CPU; on GPU the ranks would wait on each other forever).
            problems.append(f"max_tokens_per_micro_batch with expert groups that span "
                            f"data-parallel ranks ({', '.join(spanning)}: expert_parallel x "
                            f"expert_tensor_parallel > tensor_parallel x context_parallel): "
                            f"use micro_batches, or keep EP x ETP within TP x CP")
        # At least 1: a model-parallel size above nproc is reported above, not divided by.
        for dp in sorted({max(1, self.nproc // p.replica_size)
                          for p in self._valid_layouts().values()}):
            if budget is not None:  # any rows per DP rank, at least one
                if rows % self.mini_batches or rows // self.mini_batches < dp:
                    problems.append(f"prompts_per_step x samples_per_prompt = {rows} rows do "
                                    f"not split into mini_batches ({self.mini_batches}) of "
                                    f"at least DP ({dp}) rows")
            elif rows % (self.mini_batches * dp * self.micro_batches):
                problems.append(f"prompts_per_step x samples_per_prompt = {rows} rows do not "
                                f"split into mini_batches ({self.mini_batches}) x DP ({dp}) x "
                                f"micro_batches ({self.micro_batches})")
        problems += missing_dashboards(self.tensorboard, self.wandb_project)
        problems += profiling.config_problems(self.profile, self.profile_steps, self.steps)
        if problems:
            raise ValueError("invalid PPO config:\n  " + "\n  ".join(problems))

    @property
    def has_reward(self) -> bool:
        """Whether any source scores the samples (algorithm=opd trains without one)."""
        return any(bool(value) for value in (
            self.reward_model, self.reward_fn, self.reward_url, self.reward_fn_by_source,
            self.rewards, self.environment, self.agent, self.reward_judge))

    @property
    def options(self) -> AlgorithmOptions:
        """The algorithm's options with this config's settings applied."""
        return resolve(self)

    def _algorithm_problems(self) -> list[str]:
        o, problems = self.options, []
        if o.critic and self.critic is None:
            problems.append(f"algorithm {self.algorithm!r} needs a critic checkpoint "
                            f"(critic=...), or choose a critic-free algorithm")
        # REINFORCE++ whitens over the whole batch; the others compare samples of a prompt.
        if not o.critic and o.estimator not in ("reinforce++", "opd") \
                and self.samples_per_prompt < 2:
            problems.append(f"algorithm {self.algorithm!r} compares samples of one prompt: "
                            f"set samples_per_prompt >= 2")
        if o.estimator.startswith("reinforce++") and self.whiten_advantages is not None:
            problems.append(f"whiten_advantages: {self.algorithm} whitens its returns inside "
                            f"the estimator, once; leave the field unset")
        if self.advantage_std_norm is not None and o.estimator != "grpo":
            problems.append(f"advantage_std_norm applies to GRPO-style group advantages, not "
                            f"to algorithm {self.algorithm!r}")
        if o.policy_loss == "cispo" and self.dual_clip is not None:
            problems.append("dual_clip caps the clipped surrogate; policy_loss=cispo has none")
        if self.aggregation_norm is not None and o.aggregation != "seq_mean_token_sum_norm":
            problems.append("aggregation_norm is the constant of "
                            "aggregation=seq_mean_token_sum_norm only")
        if o.overlong_buffer > self.max_new_tokens:
            problems.append(f"overlong_buffer={o.overlong_buffer} is longer than "
                            f"max_new_tokens={self.max_new_tokens}")
        if o.dynamic_sampling and o.estimator not in ("grpo", "rloo"):
            problems.append(f"dynamic_sampling keeps prompts whose samples' rewards differ, "
                            f"for group advantages (grpo, rloo and their presets), not "
                            f"{self.algorithm!r}")
        if self.kl_target is not None and o.kl_coef <= 0:
            problems.append(f"kl_target steers kl_coef, which is {o.kl_coef} for "
                            f"{self.algorithm}: set kl_coef > 0")
        problems += self._distill_problems()
        low = self.rollout_correction_threshold_low
        if low is not None and (self.rollout_correction != "mis" or
                                not 0 <= low < 1):
            problems.append(f"rollout_correction_threshold_low={low} is MIS's lower bound: "
                            f"it needs rollout_correction=mis and 0 <= value < 1")
        return problems

    def _distill_problems(self) -> list[str]:
        o = self.options
        distilling = o.distill_coef > 0
        unnamed = [f"teacher_by_source.{source} must name a teacher (an HF directory or a "
                   f"checkpoint), got {path!r}"
                   for source, path in self.teacher_by_source.items()
                   if not isinstance(path, str) or not path]
        if unnamed:
            return unnamed
        taught = bool(self.teachers)
        if o.estimator == "opd":
            # opd trains on the teacher's term alone: nothing else would reach a gradient.
            ignored = [name for name, on in (("kl_coef", o.kl_coef > 0),
                                             ("overlong_buffer", bool(self.overlong_buffer)),
                                             ("clip_reward", self.clip_reward is not None),
                                             ("val_prompts", self.val_prompts is not None
                                              and not self.has_reward)) if on]
            if not distilling:
                return ["algorithm=opd trains on distill_coef x (teacher - student logprob): "
                        "set distill_coef > 0 and teacher=CKPT"]
            if ignored:
                return [f"algorithm=opd trains on the teacher's term alone, so "
                        f"{', '.join(ignored)} would change nothing: unset "
                        f"{'it' if len(ignored) == 1 else 'them'}"]
        if distilling and not taught:
            return [f"distill_coef={o.distill_coef} (algorithm {self.algorithm}) "
                    f"needs teacher=CKPT (or teacher_by_source), the model the actor "
                    f"distills from"]
        if taught and not distilling:
            return [f"{next(iter(self.teachers))} is set, but distill_coef is 0 for algorithm "
                    f"{self.algorithm}: use algorithm=opd or set distill_coef > 0"]
        if self.distill_clip is not None and not distilling:
            return ["distill_clip bounds the distillation term; set teacher and "
                    "algorithm=opd or distill_coef > 0"]
        if not taught:
            return []
        return [f"teacher with {setting}: not run yet with a teacher; {fix}"
                for setting, fix in self._untested_with_teacher()]

    def _untested_with_teacher(self) -> list[tuple[str, str]]:
        """(setting, fix) of what no test has run with a teacher yet."""
        actor, teacher = self._actor_layout(), self._own_teacher_layout()
        untested = [
            (self.reward_model is not None or self.reward_judge is not None,
             "a reward model or judge", "score with reward_fn, rewards or reward_url"),
            (max(actor.context_parallel, actor.expert_parallel) > 1,
             "context or expert parallelism", "lay the actor out in TP x PP x DP"),
            (teacher is not None and max(teacher.context_parallel, teacher.expert_parallel) > 1,
             "context or expert parallelism on its own ranks",
             "lay layout.teacher out in TP x PP x DP"),
            # Its own ranks' mesh has run at TP2 only (at PP2 in the actor's group).
            (teacher is not None and teacher.pipeline_parallel > 1,
             "pipeline parallelism on its own ranks", "lay layout.teacher out in TP x DP"),
            (self.dtype == "fp16", "dtype=fp16", "use dtype=bf16 or fp32"),
        ]
        return [(setting, fix) for bad, setting, fix in untested if bad]

    def _data_problems(self) -> list[str]:
        problems = [f"prompt_fields.{name}: not a field of prompt rows; map some of "
                    f"{list(PROMPT_FIELDS)}" for name in self.prompt_fields
                    if name not in PROMPT_FIELDS]
        problems += [f"prompt_fields.{name} must name a column (or a dotted path), got "
                     f"{column!r}" for name, column in self.prompt_fields.items()
                     if not isinstance(column, str) or not column]
        for name in ("val_every", "val_samples", "log_samples"):
            if getattr(self, name) < 0:
                problems.append(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.val_prompts is None and (self.val_every or self.val_samples):
            problems.append("val_every / val_samples need val_prompts=FILE (held-out prompts)")
        for source, spec in self.reward_fn_by_source.items():
            if not isinstance(spec, str) or not spec:
                problems.append(f"reward_fn_by_source.{source} must name a reward function, "
                                f"got {spec!r}")
        return problems

    def _episode_problems(self) -> list[str]:
        problems = []
        if self.on_env_error == "zero_reward":
            problems.append("on_env_error=zero_reward is retired: it trained a failed episode "
                            "as reward 0; use drop (mask it) or stop")
        elif self.on_env_error not in ENV_ERROR_POLICIES:
            problems.append(f"on_env_error={self.on_env_error!r} is not one of "
                            f"{list(ENV_ERROR_POLICIES)}")
        if self.tool_parser not in PARSERS and ":" not in self.tool_parser:
            problems.append(f"tool_parser={self.tool_parser!r} is not one of {list(PARSERS)} "
                            f"or 'module:function'")
        for name in ("max_turns", "tool_workers", "env_workers"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.tool_python_workers is not None and self.tool_python_workers < 1:
            problems.append(f"tool_python_workers must be >= 1 or None (the machine's cores), "
                            f"got {self.tool_python_workers}")
        if self.tool_memory_mb < 64:
            problems.append(f"tool_memory_mb must be >= 64 (a Python interpreter needs it), "
                            f"got {self.tool_memory_mb}")
        for name in ("max_turn_tokens", "max_observation_tokens"):
            value = getattr(self, name)
            if value is not None and not 1 <= value <= self.max_new_tokens:
                problems.append(f"{name}={value} must be in [1, max_new_tokens="
                                f"{self.max_new_tokens}] (max_new_tokens bounds the whole "
                                f"episode after the prompt)")
        if self.environment is None:
            unused = [name for name, default in EPISODE_FIELDS.items()
                      if getattr(self, name) != default
                      and not (self.agent is not None and name in AGENT_READS)]
            if unused and self.agent is not None:
                problems.append(f"{', '.join(unused)} apply to an environment's episodes; an "
                                f"agent's read only {' and '.join(AGENT_READS)}: leave them "
                                f"unset")
            elif unused:
                problems.append(f"{', '.join(unused)} apply to multi-turn episodes; set "
                                f"environment=... or leave them unset")
        elif (self.environment == "tools") != bool(self.tools):
            problems.append("environment=tools needs tools=[module:function, ...] (or python), "
                            "and tools need environment=tools")
        return problems

    def _agent_problems(self) -> list[str]:
        if self.agent is None:
            unused = [name for name, default in AGENT_FIELDS.items()
                      if getattr(self, name) != default]
            return [f"{', '.join(unused)} apply to agent programs; set agent=module:function "
                    f"or leave them unset"] if unused else []
        if self.environment is not None:
            return [f"agent and environment are two ways to run episodes; set one (agent="
                    f"{self.agent}, environment={self.environment})"]
        if self.routing_replay:
            return ["routing_replay with an agent: not run yet (an agent's row keeps no "
                    "routing); set routing_replay=false"]
        return []

    @property
    def episodic(self) -> bool:
        """Samples are multi-turn episodes: of an environment or of an agent program."""
        return self.environment is not None or self.agent is not None

    @property
    def turn_tokens(self) -> int:
        """max_turn_tokens with its default resolved."""
        return self.max_turn_tokens or self.max_new_tokens

    @property
    def observation_tokens(self) -> int:
        """max_observation_tokens with its default resolved."""
        return self.max_observation_tokens or self.max_new_tokens

    def _range_problems(self) -> list[str]:
        """Numeric fields outside the values that mean something (NaN and inf fail too)."""
        problems = []
        for name, low, high, closed in _RANGES:
            value = getattr(self, name)
            if value is None:
                continue
            above = low <= value if closed else low < value
            if not (above and value <= high and math.isfinite(value)):
                left, right = "[" if closed else "(", "]" if high < math.inf else ")"
                problems.append(f"{name}={value} is out of range: it must be in "
                                f"{left}{low}, {high}{right}")
        return problems

    @property
    def roles(self) -> tuple[str, ...]:
        """The model roles this run has."""
        with_critic = PRESETS.get(self.algorithm, {}).get("estimator") == "gae"
        return ("actor", "ref") + (("critic",) if with_critic else ()) + \
            (("reward",) if self.reward_model else ())

    def parallel_of(self, role: str) -> ParallelConfig:
        """The layout of model role `role` (actor, ref, critic, reward, a teacher's name),
        with its sequence parallelism (the group's mesh is the same without it:
        ppo/layout.py). With the actor's LoRA adapters the reference is the actor's engine:
        the actor's layout; the teachers have layout.teacher on ranks of their own
        (teacher_nproc), else the actor's, in whose group they run."""
        if role.startswith("teacher"):
            role = "teacher" if self.teacher_nproc is not None else "actor"
        elif role == "ref" and self.reference_is_actor_base:
            role = "actor"
        override = getattr(self.layout, LAYOUT_KEYS[role])
        layout = ParallelConfig(
            tensor_parallel=self.tensor_parallel, pipeline_parallel=self.pipeline_parallel,
            context_parallel=self.context_parallel, expert_parallel=self.expert_parallel,
            expert_tensor_parallel=self.expert_tensor_parallel).with_overrides(override)
        if override.sequence_parallel is None:
            # Inherited once the role's own TP is known (the run's may be 1 where the role's
            # is not); a role whose own TP is 1 cannot inherit it.
            layout = dataclasses.replace(layout, sequence_parallel=self.sequence_parallel
                                         and layout.tensor_parallel > 1)
        return layout

    @property
    def one_pass_old_logprobs(self) -> bool:
        """Whether the update pass gives the actor's old logprobs (old_logprobs='auto'): one
        optimizer step per rollout batch (one epoch, one mini-batch), so the update pass runs
        the weights that would compute them, over the same batch. Not with what reads them
        before training: rollout correction (its weights), the KL in the reward and the
        distillation term (the advantages), asynchronous rollouts (samples of older weights:
        the ratio to the engine needs them first); nor with LoRA dropout, which the update
        pass applies and a forward pass does not. The gap guard then runs inside the update
        pass, before its optimizer step."""
        lora = self.lora_of("actor")
        kl_in_reward = self.options.kl_in == "reward" and self.options.kl_coef > 0
        return (self.old_logprobs == "auto" and self.ppo_epochs == 1 and self.mini_batches == 1
                and self.rollout_correction == "none" and not kl_in_reward
                and not self.options.distill_coef
                and self.resolved_rollout_mode == "sync"
                and (lora is None or not lora.dropout))

    @property
    def resolved_rollout_mode(self) -> str:
        """rollout_mode, 'sync' when it is None."""
        return "sync" if self.rollout_mode is None else self.rollout_mode

    def _rollout_mode_problems(self) -> list[str]:
        if self.rollout_mode is not None and self.rollout_mode not in ROLLOUT_MODES:
            return [f"rollout_mode={self.rollout_mode!r} is not one of {list(ROLLOUT_MODES)}"]
        mode = self.resolved_rollout_mode
        if mode == "sync":
            return []
        what = f"rollout_mode={mode}"
        problems = []
        if self.placement != "disaggregated":
            problems.append(f"{what} needs placement=disaggregated (colocated, rollout and "
                            f"training share the ranks and cannot overlap)")
        if self.rollout_correction == "none":
            problems.append(f"{what} trains on samples of older weights: set "
                            f"rollout_correction=tis or mis")
        if mode != "fully_async":
            return problems
        # Not run end to end yet: refused until a test runs a step with it.
        if self.routing_replay:
            problems.append("rollout_mode=fully_async is not tested with routing_replay yet; "
                            "use rollout_mode=one_step_off")
        return problems

    def _reward_term_problems(self) -> list[str]:
        if not self.rewards:
            return []
        problems = []
        if self.reward_fn is not None or self.reward_fn_by_source:
            problems.append("reward_fn / reward_fn_by_source and rewards are both set: name the "
                            "function in rewards ({name: ..., kind: fn, function: ...})")
        names = [t.name for t in self.rewards]
        if len(set(names)) != len(names):
            problems.append(f"rewards: names {names} repeat; give each term its own name")
        taken = sorted(set(names) & set(RESERVED_REWARD_NAMES))
        if taken:
            problems.append(f"rewards: names {taken} are metrics the run logs itself "
                            f"(reward/<name>); rename those terms")
        for kind, field in _RUN_REWARDS:
            if sum(t.kind == kind for t in self.rewards) > 1:
                problems.append(f"rewards: more than one term of kind {kind} (the run has one "
                                f"{field}); weigh it once")
        for i, term in enumerate(self.rewards):
            where = f"rewards[{i}] ({term.name})"
            if not term.name.replace("_", "").isalnum():
                problems.append(f"rewards[{i}].name={term.name!r}: use letters, digits and _ "
                                f"(it names the metric reward/<name>)")
            if term.kind not in REWARD_KINDS:
                problems.append(f"{where}: kind={term.kind!r} is not one of "
                                f"{list(REWARD_KINDS)}")
            if not math.isfinite(term.weight):
                problems.append(f"{where}: weight must be a finite number, got {term.weight}")
            if (term.kind == "fn") != (term.function is not None):
                problems.append(f"{where}: 'function' goes with kind fn, and kind fn needs one")
            field = dict(_RUN_REWARDS).get(term.kind)
            if field and getattr(self, field) is None:
                problems.append(f"{where}: kind {term.kind} needs {field} set")
        kinds = {t.kind for t in self.rewards}
        for kind, field in _RUN_REWARDS:
            if getattr(self, field) is not None and kind not in kinds:
                problems.append(f"{field} is set, but no rewards term of kind {kind} uses it: "
                                f"add {{name: ..., kind: {kind}}} (with its weight)")
        return problems

    def _judge_problems(self) -> list[str]:
        judge = self.reward_judge
        if judge is None:
            return (["layout.judge.tensor_parallel is set, but no reward_judge"]
                    if self.layout.judge.tensor_parallel is not None else []) + \
                ([f"judge_nproc={self.judge_nproc} is set, but no reward_judge"]
                 if self.judge_nproc != 1 else [])
        problems = judge.problems()
        tp = self.judge_tp
        if tp < 1:
            return problems + [f"layout.judge.tensor_parallel must be >= 1, got {tp}"]
        if self.placement != "colocated":
            if self.judge_nproc % tp:
                problems.append(f"layout.judge.tensor_parallel={tp} does not divide "
                                f"judge_nproc={self.judge_nproc} (the judge's ranks, {tp} per "
                                f"engine)")
            return problems
        actor = self._actor_layout()
        if judge.backend == "vllm":
            if self.nproc % tp:
                problems.append(f"layout.judge.tensor_parallel={tp} does not divide nproc="
                                f"{self.nproc} (the ranks that run the judge's engines)")
            if self.rollout_backend == "vllm" and tp != self.rollout_tp:
                problems.append(f"layout.judge.tensor_parallel={tp}: a colocated vLLM judge "
                                f"shares vLLM's parallel state with the vLLM rollout engines "
                                f"in each rank, so it needs their size, {self.rollout_tp}; "
                                f"leave it unset")
            if self.rollout_backend == "vllm" and self.rollout_sleep:
                problems.append("reward_judge.backend=vllm beside vLLM rollouts with "
                                "rollout_sleep=true: vLLM's sleep mode (GPU) frees every "
                                "engine of a process at once; set rollout_sleep=false, "
                                "backend=megatron or placement=disaggregated")
        elif actor.pipeline_parallel > 1 or actor.context_parallel > 1 or \
                actor.expert_parallel > 1:
            problems.append("reward_judge runs colocated on a Megatron engine at PP=1, CP=1 "
                            "and EP=1 (the actor's layout): set those to 1, backend=vllm, or "
                            "placement=disaggregated for a judge on ranks of its own")
        elif tp != actor.tensor_parallel:
            problems.append(f"layout.judge.tensor_parallel={tp}: a colocated Megatron judge "
                            f"runs in the actor's layout, at tensor_parallel="
                            f"{actor.tensor_parallel}; leave it unset, or use backend=vllm "
                            f"or placement=disaggregated")
        if self.judge_nproc != 1:
            problems.append(f"judge_nproc={self.judge_nproc} needs placement=disaggregated; a "
                            f"colocated judge runs on the nproc training ranks")
        return problems

    def _own_teacher_layout(self) -> ParallelConfig | None:
        """The teachers' layout on ranks of their own (teacher_nproc); None without them or
        when it is invalid (reported by _teacher_group_problems)."""
        if self.teacher_nproc is None:
            return None
        try:
            return self.parallel_of("teacher")
        except ValueError:
            return None

    def _teacher_group_problems(self) -> list[str]:
        """teacher_nproc and layout.teacher: the teachers' group of their own."""
        nproc = self.teacher_nproc
        if self.teacher_backend == "vllm" and not self.teachers:
            return ["teacher_backend=vllm is set, but there is no teacher (or "
                    "teacher_by_source): unset it"]
        if nproc is None:
            problems = (["layout.teacher is set, but without teacher_nproc the teachers run "
                         "in the actor's group, in its layout: set teacher_nproc (with "
                         "placement=disaggregated) or leave layout.teacher unset"]
                        if self.layout.teacher.is_set else [])
            if self.teacher_backend == "vllm" and self.teachers:
                problems.append("teacher_backend=vllm runs the teachers on ranks of their own: "
                                "set teacher_nproc (with placement=disaggregated), or use "
                                "teacher_backend=megatron")
            return problems
        if nproc < 1:  # reported with the ranges
            return []
        problems = []
        if not self.teachers:
            problems.append(f"teacher_nproc={nproc} is set, but no teacher (or "
                            f"teacher_by_source): unset it")
        if self.placement != "disaggregated":
            problems.append(f"teacher_nproc={nproc} needs placement=disaggregated; a colocated "
                            f"teacher runs on the nproc training ranks")
        try:
            parallel = self.parallel_of("teacher")
        except ValueError as e:
            return problems + [f"layout.teacher: {e}"]
        if nproc % parallel.replica_size:
            return problems + [f"teacher_nproc={nproc} is not a multiple of layout.teacher's "
                               f"tensor_parallel x pipeline_parallel x context_parallel = "
                               f"{parallel.replica_size}"]
        # The experience pass deals the batch's rows over the teachers' DP replicas (vLLM
        # engines take any share).
        dp, rows = nproc // parallel.replica_size, self.rows_per_step
        uneven = (rows < dp if self.max_tokens_per_micro_batch is not None
                  else rows % (dp * self.micro_batches))
        if self.teacher_backend == "megatron" and uneven:
            problems.append(f"prompts_per_step x samples_per_prompt = {rows} rows do not split "
                            f"over the teachers' DP ({dp} = teacher_nproc / (TP x PP)) x "
                            f"micro_batches ({self.micro_batches}); change teacher_nproc")
        return problems

    @property
    def judge_tp(self) -> int:
        """Ranks per judge engine, with layout.judge.tensor_parallel's default resolved."""
        if self.layout.judge.tensor_parallel is not None:
            return self.layout.judge.tensor_parallel
        if self.placement != "colocated" or self.reward_judge is None:
            return 1
        if self.reward_judge.backend == "megatron":
            return self._actor_layout().tensor_parallel
        return self.rollout_tp if self.rollout_backend == "vllm" else 1

    def judge_engine_size(self, model: ModelConfig, longest: int, limit: int) -> EngineSize:
        """A vLLM judge engine's size (reward_judge.backend=vllm): `limit` tokens of judge
        prompt and answer (each step's are checked against it), a KV cache for its share of
        a step's judge prompts at the launch-time bound `longest`, at least one sequence of
        `limit`."""
        dtype_bytes = DTYPES[self.dtype].itemsize
        ranks = self.judge_nproc if self.placement != "colocated" else self.nproc
        rows = math.ceil(self.rows_per_step / max(1, ranks // self.judge_tp))
        kv = max(sizing.minimum_kv_cache_bytes(model, engine_tp=self.judge_tp,
                                               max_model_len=limit, dtype_bytes=dtype_bytes),
                 sizing.job_kv_cache_bytes(model, engine_tp=self.judge_tp, rows=rows,
                                           max_model_len=min(longest, limit),
                                           dtype_bytes=dtype_bytes))
        return EngineSize(max_model_len=limit, kv_cache_bytes=kv)

    def teacher_engine_size(self, model: ModelConfig, length: int, typical: int
                            ) -> EngineSize:
        """A vLLM teacher engine's size (teacher_backend=vllm): sequences of up to `length`
        tokens (VLLMEngine.score needs no room beyond them; an episode may take the models'
        whole room), a KV cache for its share of a step's rows (dealt over teacher_nproc /
        layout.teacher's TP engines) at `typical` tokens (the longest prompt +
        max_new_tokens), and at least one sequence of `length` (vLLM queues what does not
        fit at once)."""
        tp = self.parallel_of("teacher").tensor_parallel
        rows = math.ceil(self.rows_per_step / max(1, self.teacher_nproc // tp))
        dtype_bytes = DTYPES[self.dtype].itemsize
        kv = max(sizing.minimum_kv_cache_bytes(model, engine_tp=tp, max_model_len=length,
                                               dtype_bytes=dtype_bytes),
                 sizing.job_kv_cache_bytes(model, engine_tp=tp, rows=rows,
                                           max_model_len=min(typical, length),
                                           dtype_bytes=dtype_bytes))
        return EngineSize(max_model_len=length, kv_cache_bytes=kv)

    def lora_of(self, role: str) -> LoraConfig | None:
        """The LoRA adapters model role `role` trains (layout.actor.lora, layout.critic.lora);
        None for a role trained whole and for the frozen roles."""
        return getattr(self.layout, LAYOUT_KEYS[role]).lora if role in TRAINED_ROLES else None

    @property
    def reference_is_actor_base(self) -> bool:
        """The reference is the initial policy. An actor whose adapters start at zero (B = 0)
        starts as its base, so the reference is the actor's own engine with its adapters
        switched off: no copy is loaded. An actor starting from a PEFT adapter
        (lora.from_peft) has a reference of its own: the base with that adapter, frozen."""
        lora = self.lora_of("actor")
        return lora is not None and lora.from_peft is None

    @property
    def reference_adapter(self) -> LoraConfig | None:
        """The frozen adapter the reference model holds over its base: the actor's starting
        PEFT adapter, or None."""
        lora = self.lora_of("actor")
        return lora if lora is not None and lora.from_peft is not None else None

    def recompute_of(self, role: str) -> str:
        """Model role `role`'s activation recomputation (none, full or selective). The frozen
        roles (ref, reward) run forward passes only, which keep no activations to recompute:
        always 'none' (the run-wide `recompute` is for the trained roles; the config refuses
        layout.reference.recompute / layout.reward.recompute other than 'none')."""
        if role not in TRAINED_ROLES:
            return "none"
        return getattr(self.layout, LAYOUT_KEYS[role]).recompute or self.recompute

    def _actor_layout(self) -> ParallelConfig:
        return self._valid_layouts().get("actor", ParallelConfig())

    def _valid_layouts(self) -> dict[str, ParallelConfig]:
        """role -> its layout, for the roles whose layout is valid (the others are reported
        by _layout_problems)."""
        layouts = {}
        for role in self.roles:
            try:
                layouts[role] = self.parallel_of(role)
            except ValueError:
                pass
        return layouts

    def _layout_problems(self) -> list[str]:
        problems = []
        for role, key in LAYOUT_KEYS.items():
            override = getattr(self.layout, key)
            if override.recompute not in (None, *RECOMPUTE):
                problems.append(f"layout.{key}.recompute={override.recompute!r} is not one of "
                                f"{list(RECOMPUTE)}")
            elif role not in TRAINED_ROLES and override.recompute not in (None, "none"):
                problems.append(f"layout.{key}.recompute={override.recompute}: the {key} "
                                f"model is frozen (forward passes only, nothing to recompute);"
                                f" recompute applies to the actor and critic")
            if role == "ref" and override.is_set and self.reference_is_actor_base:
                problems.append("layout.reference is set, but with layout.actor.lora the "
                                "reference is the actor's own engine with its adapters off: "
                                "it has the actor's layout")
            if role not in TRAINED_ROLES and override.lora is not None:
                problems.append(f"layout.{key}.lora: the {key} model is frozen (an actor's "
                                f"adapters switched off make the reference); lora applies to "
                                f"the actor and critic")
            if not override.is_set or role == "teacher":  # teacher: _teacher_group_problems
                continue
            if role not in self.roles:
                why = f"algorithm={self.algorithm}" if role == "critic" else "no reward_model"
                problems.append(f"layout.{key} is set, but this run has no {key} model ({why})")
                continue
            try:
                parallel = self.parallel_of(role)
            except ValueError as e:
                problems.append(f"layout.{key}: {e}")
                continue
            if self.nproc % parallel.replica_size:
                problems.append(f"layout.{key}: nproc={self.nproc} is not a multiple of "
                                f"tensor_parallel x pipeline_parallel x context_parallel = "
                                f"{parallel.replica_size}")
        for role in self.roles:
            try:
                parallel = self.parallel_of(role)
            except ValueError as e:  # the run-wide layout itself (a role's is reported above)
                if not getattr(self.layout, LAYOUT_KEYS[role]).is_set:
                    problems.append(f"{e} (the run's layout)")
                continue
            if self.nproc % parallel.replica_size == 0:
                try:
                    parallel.data_parallel_size(self.nproc)
                except ValueError as e:  # the expert groups do not divide a stage
                    problems.append(f"{LAYOUT_KEYS[role]} (nproc={self.nproc}): {e}")
        problems = list(dict.fromkeys(problems))  # roles sharing the run's layout: once
        layouts = self._valid_layouts()
        # Roles that share ranks share one mesh: megatron-core's parallel state is one per
        # process.
        colocated = self.placement == "colocated"
        # Disaggregated: the reference and reward group, or with the actor's adapters the
        # reference in the actor's group (the actor's own engine) and the reward alone.
        apart = ("reward",) if self.reference_is_actor_base else ("ref", "reward")
        sharing = [r for r in (layouts if colocated else apart) if r in layouts]
        fix = ", or use placement=disaggregated" if colocated else ""
        for role in sharing[1:]:
            first, other = layouts[sharing[0]], layouts[role]
            if not first.same_mesh(other):
                problems.append(f"layout.{LAYOUT_KEYS[role]} ({other.describe()}) differs from "
                                f"layout.{LAYOUT_KEYS[sharing[0]]} ({first.describe()}), but they "
                                f"run on the same ranks (placement={self.placement}): give "
                                f"them one layout{fix}")
        return problems

    def _rollout_tp_problems(self) -> list[str]:
        tp = self.rollout_tp
        if tp < 1:
            return [f"layout.rollout.tensor_parallel must be >= 1, got {tp}"]
        problems = []
        if self.placement == "colocated":
            ranks, where = self.nproc, "nproc"
        else:
            ranks, where = self.rollout_nproc, "rollout_nproc"
        if ranks >= 1 and ranks % tp:
            problems.append(f"layout.rollout.tensor_parallel={tp} does not divide "
                            f"{where}={ranks} (the ranks that run rollout engines, {tp} per "
                            f"engine)")
        actor_tp = self._actor_layout().tensor_parallel
        if (self.placement == "colocated" and self.rollout_backend == "megatron"
                and tp != actor_tp):
            problems.append(f"layout.rollout.tensor_parallel={tp}: the colocated Megatron "
                            f"rollout backend runs in the actor's layout, at tensor_parallel="
                            f"{actor_tp}; leave layout.rollout.tensor_parallel unset, or use "
                            f"rollout_backend=vllm for engines of another size")
        return problems

    @property
    def rollout_tp(self) -> int:
        """Ranks per rollout engine, with layout.rollout.tensor_parallel's default resolved."""
        if self.layout.rollout.tensor_parallel is not None:
            return self.layout.rollout.tensor_parallel
        if self.placement == "colocated" and self.rollout_backend == "megatron":
            return self._actor_layout().tensor_parallel
        return 1

    def check_paths(self) -> None:
        """Raise ValueError naming every input path that does not exist. Kept apart from the
        field checks so a recipe can be planned (megarlhf plan) before its checkpoints exist."""
        missing = [f"{name}: {getattr(self, name)} does not exist"
                   for name in ("actor", "critic", "reward_model", "teacher", "prompts",
                                "val_prompts", "tokenizer", "chat_template")
                   if getattr(self, name) is not None and not os.path.exists(getattr(self, name))]
        missing += [f"teacher_by_source.{source}: {path} does not exist"
                    for source, path in self.teacher_by_source.items()
                    if not os.path.exists(path)]
        missing += [f"tool_python_packages: {d} is not a directory"
                    for d in self.tool_python_packages if not os.path.isdir(d)]
        if missing:
            raise ValueError("invalid PPO config:\n  " + "\n  ".join(missing))

    @property
    def teachers(self) -> dict[str, str]:
        """Each distinct teacher, by the field that names it first ('teacher', then
        'teacher_by_source.SOURCE' in the map's order) -> its path: a model role of its own
        (a path named twice is loaded once)."""
        named = [("teacher", self.teacher)] if self.teacher is not None else []
        named += [(f"teacher_by_source.{source}", path)
                  for source, path in self.teacher_by_source.items()]
        first = {}
        for name, path in named:
            first.setdefault(path, name)
        return {name: path for path, name in first.items()}

    def teacher_of(self, source: str | None) -> str | None:
        """The teacher (a key of `teachers`) scoring rows of data source `source`; None when
        no teacher does."""
        path = self.teacher_by_source.get(source, self.teacher)
        return next((name for name, p in self.teachers.items() if p == path), None)

    @property
    def rollout_engines(self) -> int:
        ranks = self.nproc if self.placement == "colocated" else self.rollout_nproc
        return max(1, ranks // self.rollout_tp)

    def vllm_engine_size(self, model: ModelConfig, longest_prompt: int) -> EngineSize:
        """The vLLM engines' size for this job; ValueError naming the field to change when an
        explicit value cannot serve the prompts (before any rank starts)."""
        needed = longest_prompt + self.max_new_tokens
        length = self.rollout_max_model_len or needed
        if length < needed:
            raise ValueError(f"rollout_max_model_len={length} is shorter than the longest "
                             f"prompt ({longest_prompt} tokens) + max_new_tokens="
                             f"{self.max_new_tokens}; set rollout_max_model_len >= {needed} "
                             f"or leave it unset")
        dtype_bytes = DTYPES[self.dtype].itemsize
        if self.rollout_gpu_memory_utilization is not None:
            return EngineSize(max_model_len=length, kv_cache_bytes=None,
                              gpu_memory_utilization=self.rollout_gpu_memory_utilization)
        least = sizing.minimum_kv_cache_bytes(model, engine_tp=self.rollout_tp,
                                              max_model_len=length, dtype_bytes=dtype_bytes)
        kv = self.rollout_kv_cache_bytes
        if kv is None:
            rows = math.ceil(self.prompts_per_step / self.rollout_engines) \
                * self.samples_per_prompt
            kv = sizing.job_kv_cache_bytes(model, engine_tp=self.rollout_tp, rows=rows,
                                           max_model_len=length, dtype_bytes=dtype_bytes)
        elif kv < least:
            raise ValueError(f"rollout_kv_cache_bytes={kv} cannot hold one sequence of "
                             f"{length} tokens (rollout_max_model_len); set "
                             f"rollout_kv_cache_bytes >= {least}")
        return EngineSize(max_model_len=length, kv_cache_bytes=kv)

    @property
    def gap_limits(self) -> GapLimits:
        """logprob_gap_limit and logprob_gap_max_limit with their dtype defaults resolved."""
        return GapLimits.of(self.dtype, self.logprob_gap_limit, self.logprob_gap_max_limit)

    @property
    def rows_per_step(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt
