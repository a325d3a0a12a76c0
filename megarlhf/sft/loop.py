"""The training loop SFT and RM share: data stream -> TrainEngine steps -> eval, checkpoints,
resume, metrics, HF export. A `Stage` says what differs (rows, batches, loss, metrics).

Every rank reads and tokenizes the whole dataset and builds the same global batch for each
step; `microbatches.Split` then takes this rank's DP share. The data position is the number
of stream items consumed, stored in every checkpoint, so a resumed run (at any layout or
batch size) continues the same sequence of examples.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Callable

import torch.distributed as dist
import yaml

from megarlhf.convert.outputs import check_output
from megarlhf.data.dataset import Examples, load_examples
from megarlhf.data.encode import Example
from megarlhf.data.order import EpochStream
from megarlhf.data.tokenizer import Tokenizer, is_tokenizer, load_tokenizer
from megarlhf.engine.checkpoint import (COMPLETE_MARKER, HF_SIDECAR, check_resumed_adapters,
                                        load_checkpoint, read_meta, save_checkpoint)
from megarlhf.engine.run_checkpoints import RunCheckpoints
from megarlhf.engine.schedule import Batch, LossFn, pad_to_multiple
from megarlhf.engine.train import TrainEngine
from megarlhf import profiling
from megarlhf.metrics import MetricsLog
from megarlhf.profiling import PhaseProfiler
from megarlhf.models.config import ModelConfig
from megarlhf.parallel.mesh import Mesh, init_mesh
from megarlhf.sft.config import StageConfig
from megarlhf.sft.microbatches import Split
from megarlhf.configio import to_dict
from megarlhf.sft.model import init_weights, model_config, new_engine


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    """'sft', 'rm' or 'dpo': log prefix, and recorded in checkpoints so a resume cannot mix them."""
    kind: str
    """Record kind read from the data ('sft', 'pairwise' or 'unpaired')."""
    value_head: bool
    rows_per_item: int
    """Batch rows per stream item: 1 (an SFT or KTO row) or 2 (a pair's chosen + rejected)."""
    row_tokens: int
    """The most tokens a batch row can hold (data.max_length; packed pairs twice that)."""
    arrange: Callable[[list[Example]], list]
    """Examples (shuffled for training, in order for eval) -> stream items."""
    to_batch: Callable[[list], Batch]
    """Stream items -> the global batch dict."""
    filler_key: str
    """Per-row tensor zeroed on filler rows, which pad the last eval batch to full size."""
    loss_fn: Callable[[Mesh, ModelConfig], LossFn]
    metrics: Callable[[dict[str, float]], dict[str, float]]
    """The loss closure's global sums -> named metrics."""
    default_margin: float = 0.0
    fingerprint: dict = dataclasses.field(default_factory=dict)
    """What else a resume must find unchanged (DPO: its loss settings and reference)."""
    annotator: Callable[[Mesh, ModelConfig, TrainEngine],
                        Callable[[list[Batch]], None]] | None = None
    """Built on every rank from the trained engine once it holds its starting (or resumed)
    weights: a function that adds values to a step's (or an evaluation's) micro-batches
    before they run (DPO's reference logprobs, KTO's KL estimate)."""
    prepare: Callable[[Mesh, ModelConfig, TrainEngine, Examples],
                      tuple[Examples, dict]] | None = None
    """Called on every rank once the trained engine holds its starting (or resumed) weights:
    the examples with values computed once for the whole run (DPO's cached reference
    logprobs), and a record of what it did (logged as a "prepare" event, its `summary`
    printed)."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a run needs before any process group exists, checked: the tokenizer, the stage,
    the architecture, the tokenized data, and where to resume from."""

    tokenizer: Tokenizer
    stage: Stage
    model: ModelConfig
    examples: Examples
    resume_from: str | None
    resume_step: int
    """The step of `resume_from` (0 for a new run)."""
    fingerprint: dict
    """Recorded in checkpoints; a resume must match it (same stage, same data order)."""


def plan(cfg: StageConfig, make_stage: Callable[[int], Stage]) -> Plan:
    """`make_stage(pad_id)` gives the stage for the configured tokenizer's padding id."""
    tokenizer = load_tokenizer(_tokenizer_path(cfg))
    stage = make_stage(tokenizer.pad_id)
    model = model_config(cfg.model, value_head=stage.value_head)
    _check_fit(model, tokenizer, cfg.data.max_length)
    _check_budget(cfg, stage, model)
    examples = load_examples(cfg.data, stage.kind, tokenizer,
                             default_margin=stage.default_margin)
    fingerprint = {"stage": stage.name, "train_examples": len(examples.train),
                   "data_seed": cfg.data.seed, **stage.fingerprint}
    if cfg.train.export_hf:  # found now, not after the training it would follow
        check_output(cfg.train.export_hf, replace=True, what="train.export_hf",
                     inputs=[run_checkpoints(cfg.train.output_dir).root])
    latest = run_checkpoints(cfg.train.output_dir).latest()
    if latest and not cfg.train.resume:
        raise ValueError(f"{cfg.train.output_dir} already holds checkpoints ({latest}); set "
                         f"train.resume=true to continue that run or use another output_dir")
    resume_step = 0
    if latest:
        extra = read_meta(latest)["extra"]
        _check_resume(latest, extra, fingerprint)
        check_resumed_adapters(latest, cfg.model.lora, "model.lora", base=cfg.model.checkpoint,
                               base_field="model.checkpoint")
        resume_step = extra["step"]
    return Plan(tokenizer=tokenizer, stage=stage, model=model, examples=examples,
                resume_from=latest, resume_step=resume_step, fingerprint=fingerprint)


def run_checkpoints(output_dir: str) -> RunCheckpoints:
    """The run's step checkpoints: each one model checkpoint, complete with its marker."""
    return RunCheckpoints(output_dir, marker=COMPLETE_MARKER)


def split(cfg: StageConfig, rows_per_item: int, mesh: Mesh) -> Split:
    """How this rank takes its micro-batches from a global batch of items of
    `rows_per_item` rows."""
    train = cfg.train
    return Split(dp_size=mesh.dp_size, dp_rank=mesh.dp_rank, rows_per_item=rows_per_item,
                 multiple=cfg.parallel.sequence_multiple,
                 num_microbatches=train.num_microbatches(mesh.dp_size),
                 max_tokens=train.max_tokens_per_micro_batch)


def run(cfg: StageConfig, make_stage: Callable[[int], Stage]) -> dict:
    """Train on every rank of the job; returns (on every rank) the final checkpoint path, the
    HF export path, the metric history and the data report."""
    p = plan(cfg, make_stage)
    train = cfg.train
    mesh = init_mesh(cfg.parallel, seed=train.seed)
    log = MetricsLog(train.output_dir if mesh.rank == 0 else None, name=p.stage.name,
                     steps=train.steps, resumed_step=p.resume_step,
                     tensorboard=train.tensorboard, wandb_project=train.wandb_project,
                     run_config=to_dict(cfg))
    try:
        return _train(cfg, p, mesh, log)
    finally:
        log.close()


def _train(cfg: StageConfig, p: Plan, mesh: Mesh, log: MetricsLog) -> dict:
    stage, train = p.stage, cfg.train
    to_microbatches = split(cfg, stage.rows_per_item, mesh)
    checkpoints = run_checkpoints(train.output_dir)
    if mesh.rank == 0:
        checkpoints.remove_leftovers()
        os.makedirs(checkpoints.root, exist_ok=True)
        with open(os.path.join(train.output_dir, "config.yaml"), "w") as f:
            yaml.safe_dump(to_dict(cfg), f, sort_keys=False)
    dist.barrier()
    log.write({"event": "data", **p.examples.report}, echo=False)
    log.note(_data_line(p.examples))

    engine = new_engine(cfg.model, p.model, cfg.parallel, mesh, cfg.optim,
                        value_head=stage.value_head)
    step, consumed = 0, 0
    if p.resume_from:
        extra = load_checkpoint(p.resume_from, engine, with_optimizer=True,
                                base=cfg.model.checkpoint)
        step, consumed = extra["step"], extra["items_consumed"]
        log.note(f"resumed from {p.resume_from} at step {step}")
    else:
        log.note(init_weights(cfg.model, engine))
    # Checkpoints carry the tokenizer, so later stages and exports find it with the weights.
    engine.provenance["hf_files"] = {**engine.provenance["hf_files"], **p.tokenizer.files()}

    loss_fn = stage.loss_fn(mesh, p.model)
    annotate = stage.annotator(mesh, p.model, engine) if stage.annotator else None
    examples = p.examples
    if stage.prepare:
        examples, record = stage.prepare(mesh, p.model, engine, examples)
        log.write({"event": "prepare", **record}, echo=False)
        log.note(record["summary"])
    stream = EpochStream(examples.train, seed=cfg.data.seed, arrange=stage.arrange)
    eval_batches = _eval_batches(examples.eval, stage, train.global_batch_size,
                                 cfg.parallel.sequence_multiple)
    history, final = [], p.resume_from
    profiler = PhaseProfiler(train.output_dir, f"rank{mesh.rank}")
    while step < train.steps:
        items, epoch = stream.take(consumed, train.global_batch_size)
        consumed += len(items)
        step += 1
        if profiling.profiled(train.profile, train.profile_steps, step):
            profiler.start(step)
        t0 = time.perf_counter()
        with profiler.phase("train"):
            microbatches = to_microbatches(stage.to_batch(items))
            if annotate:
                annotate(microbatches)
            m = engine.train_step(microbatches, loss_fn)
        record = {"step": step, "split": "train", **stage.metrics(m.sums),
                  "grad_norm": m.grad_norm, "lr": m.lr, "epoch": round(epoch, 4),
                  "step_s": round(time.perf_counter() - t0, 4),
                  # This rank's: with a token budget DP ranks may differ.
                  "microbatches": len(microbatches)}
        if m.skipped:
            record["update_skipped"] = True  # non-finite gradients
        log.write(record, echo=step % train.log_interval == 0 or step == train.steps)
        history.append(record)
        last = step == train.steps
        if eval_batches and (last or train.eval_interval and step % train.eval_interval == 0):
            with profiler.phase("eval"):
                record = {"step": step, "split": "eval",
                          **evaluate(engine, eval_batches, loss_fn, to_microbatches,
                                     stage.metrics, annotate)}
            log.write(record)
            history.append(record)
        if profiler.step is not None:  # rank 0's tables; every rank wrote its traces
            tables = profiler.take()
            log.note(profiling.format_tables(step, "rank 0", tables))
            log.write({"event": "profile", "profiled_step": step, "phases": tables},
                      echo=False)
        if last or train.save_interval and step % train.save_interval == 0:
            final = checkpoints.path(step)
            save_checkpoint(final, engine, mesh,
                            extra={**p.fingerprint, "step": step, "items_consumed": consumed})
            if mesh.rank == 0:
                checkpoints.prune(train.keep_last)
    log.note(f"final checkpoint {final}")
    export = _export(final, train.export_hf, mesh, log) if train.export_hf else None
    return {"checkpoint": final, "export": export, "history": history,
            "data": p.examples.report}


def evaluate(engine: TrainEngine, batches: list[Batch], loss_fn: LossFn, to_microbatches: Split,
             metrics, annotate=None) -> dict[str, float]:
    totals: dict[str, float] = {}
    for batch in batches:
        microbatches = to_microbatches(batch)
        if annotate:
            annotate(microbatches)
        sums = engine.global_sums(engine.forward(microbatches, loss_fn))
        for k, v in sums.items():
            totals[k] = totals.get(k, 0.0) + v
    return metrics(totals)


def _eval_batches(examples: list[Example], stage: Stage, batch_items: int,
                  multiple: int) -> list[Batch]:
    """All eval examples in global batches of `batch_items` (widths padded to `multiple`);
    the last one is filled up with copies of its last item whose `filler_key` is zero, so
    they count for nothing (KTO pairs each row with the one before it: the first row's
    partner is then the last real row, not itself)."""
    if not examples:
        return []
    items = stage.arrange(examples)
    batches = []
    for start in range(0, len(items), batch_items):
        chunk = items[start:start + batch_items]
        real = len(chunk)
        batch = stage.to_batch(chunk + [chunk[-1]] * (batch_items - real))
        batch[stage.filler_key][real * stage.rows_per_item:] = 0
        batches.append(pad_to_multiple(batch, multiple))
    return batches


def _check_resume(path: str, extra: dict, fingerprint: dict) -> None:
    changed = {k: (extra.get(k), v) for k, v in fingerprint.items() if extra.get(k) != v}
    if changed:
        raise ValueError(
            f"cannot resume from {path}: {changed} (checkpoint vs now) changed, so the run "
            f"would not continue the same data and objective; use a new output_dir and start "
            f"it from the "
            f"checkpoint with model.checkpoint={path}")


def _tokenizer_path(cfg) -> str:
    if cfg.data.tokenizer is not None:
        return cfg.data.tokenizer
    sidecar = os.path.join(cfg.model.checkpoint or "", HF_SIDECAR)
    if cfg.model.checkpoint is None or not is_tokenizer(sidecar):
        raise ValueError("data.tokenizer is not set and the model checkpoint carries no "
                         "tokenizer; give data.tokenizer (an HF tokenizer directory or a "
                         "SentencePiece .model)")
    return sidecar


def _check_fit(model: ModelConfig, tokenizer: Tokenizer, max_length: int) -> None:
    if tokenizer.vocab_size > model.vocab_size:
        raise ValueError(f"{tokenizer} has {tokenizer.vocab_size} tokens, more than the "
                         f"model's vocab_size={model.vocab_size}; use a matching tokenizer or "
                         f"(presets) model.overrides.vocab_size={tokenizer.vocab_size}")
    if max_length > model.max_position_embeddings:
        raise ValueError(f"data.max_length={max_length} exceeds the model's "
                         f"max_position_embeddings={model.max_position_embeddings}")


def _check_budget(cfg: StageConfig, stage: Stage, model: ModelConfig) -> None:
    """A token budget must hold the longest item the data may have (checked here, before
    any rank starts, from the row bound: no item is then too long at a later step); and
    since DP ranks then run their own numbers and shapes of micro-batches, no collective
    may span DP ranks within a micro-batch, and the schedule must take any count."""
    budget = cfg.train.max_tokens_per_micro_batch
    if budget is None:
        return
    parallel = cfg.parallel
    if model.num_experts and \
            parallel.expert_group_size > parallel.tensor_parallel * parallel.context_parallel:
        # An MoE forward is a collective over the expert group (as for PPO's budget).
        raise ValueError("train.max_tokens_per_micro_batch with expert groups that span "
                         "data-parallel ranks (expert_parallel x expert_tensor_parallel > "
                         "tensor_parallel x context_parallel): use train.micro_batch_size, "
                         "or keep EP x ETP within TP x CP")
    if parallel.virtual_pipeline_parallel:
        # The interleaved schedule needs a multiple of pipeline_parallel micro-batches.
        raise ValueError("train.max_tokens_per_micro_batch with "
                         "parallel.virtual_pipeline_parallel: the interleaved schedule needs "
                         "the same multiple of pipeline_parallel micro-batches on every rank; "
                         "use train.micro_batch_size")
    multiple = parallel.sequence_multiple
    need = stage.rows_per_item * (stage.row_tokens + -stage.row_tokens % multiple)
    if budget < need:
        rows = "a pair's two rows" if stage.rows_per_item == 2 else "a row"
        raise ValueError(f"train.max_tokens_per_micro_batch={budget} cannot hold {rows} of up "
                         f"to {stage.row_tokens} tokens ({need} padded to a multiple of "
                         f"{multiple}); raise it to at least {need} or lower data.max_length")


def _data_line(examples: Examples) -> str:
    r = examples.report
    line = (f"{r['train']['kept']} training examples from {r['train']['path']} "
            f"({r['template']} format), {len(examples.eval)} eval")
    for split in ("train", "eval"):
        if r[split].get("skipped"):
            line += f"; {split}: skipped {r[split]['skipped']} bad records " \
                    f"{r[split]['reasons']}"
        if any(r[split].get("truncated", {}).values()):
            line += f"; {split}: truncated {r[split]['truncated']}"
    return line


def _export(ckpt: str, out: str, mesh: Mesh, log: MetricsLog) -> str:
    """The final checkpoint as an HF directory at `out`, replacing an earlier export of ours
    (`plan` checked that it is not around the checkpoints and not someone else's)."""
    from megarlhf.convert.mcore_to_hf import mcore_to_hf

    if mesh.rank == 0:
        mcore_to_hf(ckpt, out, force=True)
        log.note(f"exported {ckpt} to {out}")
    dist.barrier()
    return os.path.abspath(out)
