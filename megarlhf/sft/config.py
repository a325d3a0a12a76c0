"""The run configs of `megarlhf sft` and `megarlhf rm`: one frozen dataclass per concern, each
validated when built. A YAML file maps onto them key for key (configio.load_config)."""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from megarlhf.data.config import DataConfig
from megarlhf.data.records import field_columns
from megarlhf.engine.optim import OptimConfig
from megarlhf import profiling
from megarlhf.metrics import missing_dashboards
from megarlhf.models.config import ModelConfig
from megarlhf.models.lora import LoraConfig, layout_problem
from megarlhf.models.presets import preset
from megarlhf.models.specs import TE_REFUSED
from megarlhf.models.transformer_config import parse_dtype
from megarlhf.parallel.mesh import ParallelConfig

LAYER_SPECS = ("auto", "local", "sdpa", "te")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ModelSource:
    preset: str | None = None
    """A named architecture (megarlhf.models.presets) with fresh weights seeded by
    `train.seed`."""
    checkpoint: str | None = None
    """A megarlhf checkpoint (converted from HF, or an earlier stage's output). A reward model
    can start from an LM checkpoint: its trunk is loaded and the value head starts fresh."""
    overrides: dict[str, Any] = dataclasses.field(default_factory=dict)
    """ModelConfig fields replaced in the preset, e.g. {vocab_size: 256}; presets only."""
    dtype: str = "fp32"
    """Parameter dtype: fp32, bf16 or fp16."""
    layer_spec: str = "auto"
    """Megatron layer spec: auto (SDPA, on GPU and CPU), local, sdpa; te (Transformer
    Engine) is refused until verified (models/specs.TE_REFUSED)."""
    lora: LoraConfig | None = None
    """Train low-rank adapters on the linear layers instead of every weight (the base is
    frozen; a reward model's value head trains too); None trains every weight."""

    def __post_init__(self):
        if (self.preset is None) == (self.checkpoint is None):
            raise ValueError("model needs exactly one of preset or checkpoint")
        if self.overrides and self.preset is None:
            raise ValueError("model.overrides apply to presets only; a checkpoint's "
                             "architecture is fixed by its weights")
        parse_dtype(self.dtype)
        if self.layer_spec not in LAYER_SPECS:
            raise ValueError(f"unknown layer_spec {self.layer_spec!r}; choose one of "
                             f"{LAYER_SPECS}")
        if self.layer_spec == "te":
            raise ValueError(f"model.layer_spec 'te': {TE_REFUSED}")
        if self.preset is not None:
            self.preset_config()  # unknown preset or override fields fail here

    def preset_config(self) -> ModelConfig:
        return ModelConfig.from_dict({**preset(self.preset).to_dict(), **self.overrides})


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopConfig:
    output_dir: str
    """Checkpoints (checkpoints/step_N), metrics.jsonl, the dashboards' files and the resolved
    config.yaml."""
    steps: int
    """Optimizer steps in total (a resumed run continues up to this number)."""
    global_batch_size: int
    """Rows per step over all DP ranks: SFT sequences (packed rows when packing) or RM
    pairs. Must be a multiple of data-parallel size x micro_batch_size."""
    micro_batch_size: int = 1
    """Rows (SFT) or pairs (RM) per micro-batch on one DP rank."""
    max_tokens_per_micro_batch: int | None = None
    """Instead of micro_batch_size: micro-batches of up to this many model tokens (rows x
    the micro-batch's width, cut to the longest row it holds), so short rows share a
    micro-batch and long ones do not pad the rest; a pair's two rows stay together. Items
    go to the DP ranks balanced by tokens, so ranks may run different numbers of
    micro-batches. Must hold the longest item: rows per item x data.max_length (packed DPO
    rows: 2 x data.max_length), padded to the layout's multiple."""
    eval_interval: int = 0
    """Evaluate every this many steps (0: only after the last step); needs eval data."""
    save_interval: int = 0
    """Checkpoint every this many steps (0: only after the last step)."""
    keep_last: int = 2
    """Keep the last this many checkpoints; older ones are deleted after each save."""
    resume: bool = True
    """Continue from the latest complete checkpoint in output_dir. False refuses an output_dir
    that already has checkpoints rather than mixing two runs."""
    export_hf: str | None = None
    """After the last step, export the final checkpoint here as an HF model (replacing what
    is there)."""
    log_interval: int = 1
    """Print every this many steps (metrics.jsonl gets every step)."""
    seed: int = 0
    """Seeds fresh (preset) weights and the reward model's new value head."""
    # -- dashboards (metrics.jsonl and the console always) --
    tensorboard: bool = False
    """Also write TensorBoard event files to output_dir/tensorboard (needs `tensorboard`)."""
    wandb_project: str | None = None
    """Also log to this W&B project (needs `wandb` and a login); a resumed run continues the
    same W&B run."""
    profile: bool = False
    """Profile the training step (and evaluation) of the steps in profile_steps on every
    rank: a Chrome trace per rank in output_dir/profile/step_<N>/, and a table per phase
    (operator time by category, the top operators, time outside operators) printed and
    logged as a "profile" event in metrics.jsonl (megarlhf/profiling.py). CPU only so far:
    refused on a GPU machine."""
    profile_steps: tuple[int, ...] | None = None
    """The steps `profile` profiles; None: every step the run takes."""

    def __post_init__(self):
        for name in ("steps", "global_batch_size", "micro_batch_size", "log_interval",
                     "keep_last"):
            if getattr(self, name) < 1:
                raise ValueError(f"train.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("eval_interval", "save_interval"):
            if getattr(self, name) < 0:
                raise ValueError(f"train.{name} must be >= 0, got {getattr(self, name)}")
        budget = self.max_tokens_per_micro_batch
        if budget is not None and budget < 1:
            raise ValueError(f"train.max_tokens_per_micro_batch must be >= 1 or null, got "
                             f"{budget}")
        if budget is not None and self.micro_batch_size != 1:
            raise ValueError("train.max_tokens_per_micro_batch sets the rows of each "
                             "micro-batch: give it or train.micro_batch_size, not both")
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(f"train.global_batch_size ({self.global_batch_size}) must be a "
                             f"multiple of train.micro_batch_size ({self.micro_batch_size})")
        missing = missing_dashboards(self.tensorboard, self.wandb_project) + \
            profiling.config_problems(self.profile, self.profile_steps, self.steps, "train.")
        if missing:
            raise ValueError("train: " + "; ".join(missing))

    def num_microbatches(self, dp_size: int) -> int:
        """Micro-batches per DP rank by count (with a token budget every DP rank needs an
        item; the budget then decides how many)."""
        per_step = dp_size * self.micro_batch_size
        if self.global_batch_size % per_step:
            raise ValueError(
                f"train.global_batch_size ({self.global_batch_size}) must be a multiple of "
                f"data-parallel size x micro_batch_size = {dp_size} x {self.micro_batch_size}")
        return self.global_batch_size // per_step


@dataclasses.dataclass(frozen=True, kw_only=True)
class StageConfig:
    """What both stages configure; each stage adds its own fields."""

    RECORD_KIND: ClassVar[str]
    """The records the stage reads ('sft' or 'pairwise'; see record_kind)."""
    model: ModelSource
    """The model trained: a preset or a checkpoint, its dtype, layer spec and adapters."""
    data: DataConfig
    """The datasets, tokenizer, template and lengths."""
    train: LoopConfig
    """Steps, batch sizes, evaluation, checkpoints, logging."""
    parallel: ParallelConfig = dataclasses.field(default_factory=ParallelConfig)
    """TP x PP x CP x EP (x DP: the rest of --nproc)."""
    optim: OptimConfig = dataclasses.field(default_factory=OptimConfig)
    """The optimizer and learning-rate schedule."""

    def record_kind(self) -> str:
        """The records this run reads (a stage whose settings choose it overrides this)."""
        return self.RECORD_KIND

    def __post_init__(self):
        _check_data(self.data, self.train, self.record_kind())
        problem = self.model.lora and layout_problem(self.model.lora, self.parallel)
        if problem:
            raise ValueError(f"model.lora: {problem}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class SFTConfig(StageConfig):
    RECORD_KIND: ClassVar[str] = "sft"
    pack: bool = True
    """Pack several documents into each row of data.max_length tokens (each attending only
    to itself, positions restarting per document) instead of one padded document per row."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RMConfig(StageConfig):
    RECORD_KIND: ClassVar[str] = "pairwise"
    margin: float = 0.0
    """Loss -logsigmoid(chosen - rejected - margin); a pair's own margin field (mapped with
    data.train.fields.margin) replaces it."""


DPO_LOSSES = ("dpo", "ipo", "simpo", "kto")
DPO_REFERENCES = ("live", "cached")
DPO_DEFAULT_BETA = {"dpo": 0.1, "ipo": 0.1, "simpo": 2.0, "kto": 0.1}
KTO_FIELDS = ("desirable_weight", "undesirable_weight")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPOSettings:
    loss: str = "dpo"
    """dpo: -log sigmoid(beta h), h = the chosen response's log-ratio to the reference minus
    the rejected one's (logprobs summed over response tokens); ipo: (h' - 1/(2 beta))^2 with
    h' from logprobs averaged over response tokens; simpo: -log sigmoid(beta (chosen's mean
    token logprob - rejected's) - gamma), no reference model; kto: unpaired rows (prompt,
    completion, label), 1 - sigmoid(beta (r - z)) for a desirable completion and
    1 - sigmoid(beta (z - r)) for an undesirable one, r its log-ratio to the reference and z
    the batch's KL estimate from mismatched prompt/completion rows."""
    beta: float | None = None
    """The loss's temperature; None: the loss's own default (dpo 0.1, ipo 0.1, simpo 2.0,
    kto 0.1)."""
    label_smoothing: float = 0.0
    """dpo and simpo: the share of pairs assumed mislabeled (conservative DPO): the loss is
    (1 - e) of the pair's term plus e of the term with chosen and rejected swapped."""
    gamma: float = 0.5
    """simpo: the target reward margin subtracted inside the sigmoid."""
    sft_weight: float = 0.0
    """dpo, ipo, simpo: adds this weight times the chosen response's mean token negative
    log-likelihood."""
    desirable_weight: float = 1.0
    """kto: the weight of a desirable row's loss (raise it when desirable rows are rarer)."""
    undesirable_weight: float = 1.0
    """kto: the weight of an undesirable row's loss."""
    reference: str = "live"
    """dpo, ipo: live scores each step's pairs with the reference just before the step (its
    weights stay in memory all run); cached scores every training and evaluation pair once
    before the first step (again on a resume), keeps the two logprobs per pair with the
    data and frees the reference's weights, so training holds only the policy and skips the
    reference forward of every step. kto must be live: its KL estimate scores pairings that
    depend on each step's batch."""

    def __post_init__(self):
        if self.loss not in DPO_LOSSES:
            raise ValueError(f"dpo.loss={self.loss!r}: choose one of {', '.join(DPO_LOSSES)}")
        if self.beta is not None and not self.beta > 0:
            raise ValueError(f"dpo.beta={self.beta} must be > 0")
        if not 0 <= self.label_smoothing < 0.5:
            raise ValueError(f"dpo.label_smoothing={self.label_smoothing} must be in [0, 0.5)")
        if self.label_smoothing and self.loss == "ipo":
            raise ValueError("dpo.label_smoothing applies to dpo and simpo, not ipo")
        if self.sft_weight < 0:
            raise ValueError(f"dpo.sft_weight={self.sft_weight} must be >= 0")
        if self.loss == "kto" and self.sft_weight:
            raise ValueError("dpo.sft_weight applies to dpo, ipo and simpo, not kto")
        for name in KTO_FIELDS:
            if not getattr(self, name) > 0:
                raise ValueError(f"dpo.{name}={getattr(self, name)} must be > 0")
            if self.loss != "kto" and getattr(self, name) != 1.0:
                raise ValueError(f"dpo.{name} applies to kto, not {self.loss}")
        if self.reference not in DPO_REFERENCES:
            raise ValueError(f"dpo.reference={self.reference!r}: choose one of "
                             f"{', '.join(DPO_REFERENCES)}")
        if self.reference == "cached" and self.loss in ("simpo", "kto"):
            raise ValueError(
                "dpo.reference=cached applies to dpo and ipo: simpo has no reference" if
                self.loss == "simpo" else "dpo.reference=cached: kto's KL estimate scores "
                "pairings made in each step's batch, so its reference must be live")

    @property
    def temperature(self) -> float:
        return self.beta if self.beta is not None else DPO_DEFAULT_BETA[self.loss]

    @property
    def needs_reference(self) -> bool:
        return self.loss != "simpo"

    def fingerprint(self) -> dict:
        """What a resume must find unchanged: every field this loss reads (KTO's weights only
        for kto, and `reference` only when cached, so earlier runs resume across their
        introduction). Cached and live reference logprobs differ in rounding (other batch
        widths), so a resume keeps the choice."""
        fields = dataclasses.asdict(self)
        if self.reference == "live":
            del fields["reference"]
        return {k: v for k, v in fields.items() if self.loss == "kto" or k not in KTO_FIELDS}


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPOConfig(StageConfig):
    dpo: DPOSettings = dataclasses.field(default_factory=DPOSettings)
    """The preference loss. The reference (dpo, ipo, kto) is a frozen copy of the model the run
    starts from (model.checkpoint), at the same layout, on the same ranks; with model.lora it
    is the trained model with its adapters off (the base: no second copy)."""
    pack: bool = False
    """dpo, ipo, simpo: pack several pairs into each row of 2 x data.max_length tokens (each
    sequence attending only to itself, positions restarting; a pair's two sequences always in
    the same row), train.global_batch_size then counting rows; false: one sequence per row,
    a pair on two adjacent rows."""

    def record_kind(self) -> str:
        return "unpaired" if self.dpo.loss == "kto" else "pairwise"

    def __post_init__(self):
        super().__post_init__()
        if self.dpo.loss == "kto" and self.pack:
            raise ValueError("pack applies to the pair losses (dpo, ipo, simpo), not kto")
        if self.dpo.loss == "kto" and self.train.global_batch_size < 2:
            raise ValueError("dpo.loss=kto needs train.global_batch_size >= 2 (its KL estimate "
                             "pairs each prompt with another row's completion)")
        if self.model.checkpoint is None:
            raise ValueError("dpo: model.checkpoint is required (preference optimization starts "
                             "from a trained model, usually the SFT stage's output)")


def _check_data(data: DataConfig, train: LoopConfig, kind: str) -> None:
    for source in (data.train, data.eval):
        if source is not None:
            field_columns(source, kind)
    if train.eval_interval and data.eval is None and data.eval_fraction == 0:
        raise ValueError("train.eval_interval is set but there is no eval data; give data.eval "
                         "or data.eval_fraction")
