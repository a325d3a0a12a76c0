"""HF safetensors checkpoint -> Megatron dist checkpoint, streamed one chunk at a time.

The output is layout-free (it loads at any TP/PP/VPP); the layout given here is validated
against the architecture up front and recorded as the intended training layout.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import transformers

from megarlhf.convert.mcore_io import checkpoint_template, write_checkpoint
from megarlhf.convert.outputs import (copy_sidecar, finish_output, prepare_output,
                                      removed_on_error)
from megarlhf.convert.safetensors_io import SafetensorsReader
from megarlhf.engine.checkpoint import HF_SIDECAR, checkpoint_meta, publish
from megarlhf.models.arch import TensorRule, architecture_for_hf_config, hf_shapes
from megarlhf.models.config import ModelConfig
from megarlhf.parallel.mesh import ParallelConfig

ROLES = ("actor", "ref", "critic", "reward")
VALUE_ROLES = ("critic", "reward")


@dataclasses.dataclass(frozen=True)
class HFSource:
    """What an HF directory holds, checked: architecture, our model config, role."""

    arch_name: str
    hf_class: str
    model: ModelConfig
    value_head: bool
    init_value_head: bool
    dtype: torch.dtype
    rules: tuple[TensorRule, ...]
    reader: SafetensorsReader


def inspect_hf(hf_dir: str, *, role: str = "actor", init_value_head: bool = False,
               make_vocab_size_divisible_by: int = 128) -> HFSource:
    """Read and validate an HF checkpoint directory for conversion to `role`."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; choose one of {ROLES}")
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise ValueError(f"{hf_dir} has no config.json; is it an HF model directory?")
    config = transformers.AutoConfig.from_pretrained(hf_dir)
    arch, is_seq_cls = architecture_for_hf_config(config, hf_dir)
    hf_class = arch.hf_class(is_seq_cls)
    value_head = role in VALUE_ROLES
    if value_head and arch.sequence_classification is None:
        raise ValueError(f"{hf_class} in {hf_dir} has no value-model form here; convert it as "
                         f"actor or ref, not as {role}")
    if value_head and is_seq_cls and config.num_labels != 1:
        raise ValueError(f"{hf_class} in {hf_dir} has {config.num_labels} labels; a {role} "
                         f"needs a single score (num_labels=1)")
    if value_head and not is_seq_cls and not init_value_head:
        raise ValueError(
            f"{hf_dir} holds a causal LM ({hf_class}); a {role} is converted from "
            f"{arch.sequence_classification} with one label, or pass --init-value-head to start "
            f"it from this LM with a freshly initialised value head")
    if not value_head and is_seq_cls:
        raise ValueError(f"{hf_dir} holds {hf_class} (a scalar head, no LM head); it can be "
                         f"converted as a critic or reward (--role critic|reward), not as {role}")
    model = arch.model_config(config, make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    rules = arch.rules(model, lm_head=not value_head, value_head=value_head)
    reader = SafetensorsReader(hf_dir, aliases=arch.hf_aliases)
    fresh_head = value_head and not is_seq_cls
    _check_tensors(hf_dir, reader, model, rules, skip_value_head=fresh_head)
    dtype = reader.dtype(rules[0].hf[0])  # the embedding's dtype is the checkpoint's dtype
    return HFSource(arch.name, hf_class, model, value_head, fresh_head, dtype, tuple(rules),
                    reader)


def _check_tensors(hf_dir, reader, model, rules, *, skip_value_head: bool) -> None:
    expected = hf_shapes([r for r in rules if not (skip_value_head and
                                                   r.mcore.startswith("value_head."))], model)
    problems = []
    for name, shape in expected.items():
        if name not in reader:
            problems.append(f"missing tensor {name} (expected shape {shape})")
        elif reader.shape(name) != shape:
            problems.append(f"tensor {name} has shape {reader.shape(name)} but config.json "
                            f"implies {shape}")
    # Tied checkpoints may still carry lm_head; an LM seeding a critic carries an unused head.
    ignorable = ("lm_head.weight",) if (model.tie_embeddings or skip_value_head) else ()
    extra = [n for n in reader.names() if n not in expected and n not in ignorable
             and not n.endswith("rotary_emb.inv_freq")]
    if extra:
        problems.append(f"unexpected tensors (a feature this converter does not map?): "
                        f"{sorted(extra)[:8]}{' ...' if len(extra) > 8 else ''}")
    if problems:
        raise ValueError(f"{hf_dir} does not match its config.json:\n  " + "\n  ".join(problems))
    dtypes = {reader.dtype(n) for n in expected}
    if len(dtypes) > 1:
        raise ValueError(f"{hf_dir} mixes tensor dtypes {sorted(map(str, dtypes))}; re-save it in "
                         f"one dtype")


def hf_to_mcore(hf_dir: str, out: str, *, parallel: ParallelConfig, role: str = "actor",
                init_value_head: bool = False, seed: int = 0, force: bool = False,
                make_vocab_size_divisible_by: int = 128) -> dict:
    """Convert; returns the checkpoint's metadata (as stored in its completion marker)."""
    src = inspect_hf(hf_dir, role=role, init_value_head=init_value_head,
                     make_vocab_size_divisible_by=make_vocab_size_divisible_by)
    src.model.check_parallel(parallel)
    tmp = prepare_output(out, force, inputs=[hf_dir])
    reader = src.reader
    by_key = {rule.mcore: rule for rule in src.rules}

    def source(key: str, index: tuple[int, ...], shape: tuple[int, ...]) -> list[torch.Tensor]:
        rule = by_key.get(key)
        if rule is None:
            raise ValueError(f"Megatron expects {key!r}, which no {src.arch_name} rule produces")
        if src.init_value_head and key.startswith("value_head."):
            g = torch.Generator().manual_seed(seed)
            return [(torch.randn(shape, generator=g) * src.model.init_std).to(src.dtype)]
        names = rule.hf_names(index)
        if rule.vocab and reader.shape(names[0])[0] < shape[0]:
            (name,) = names  # read into the first rows; Megatron's padding rows are zeros
            padded, rows = torch.empty(shape, dtype=src.dtype), reader.shape(name)[0]
            reader.get(name, out=padded[:rows])
            padded[rows:].zero_()
            return [padded]
        # Views of the file's pages, in Megatron's row order: written as they are stored,
        # never copied into fresh memory (not even the fused QKV).
        return rule.rows([reader.view(n) for n in names])

    with removed_on_error(tmp):
        template = checkpoint_template(src.model, value_head=src.value_head, dtype=src.dtype)
        write_checkpoint(tmp, template, source)
        copy_sidecar(hf_dir, os.path.join(tmp, HF_SIDECAR))
        finish_output(tmp)
    meta = checkpoint_meta(
        src.model, value_head=src.value_head, dtype=src.dtype,
        layout={"tp": parallel.tensor_parallel, "pp": parallel.pipeline_parallel, "dp": None,
                "vpp": parallel.virtual_pipeline_parallel, "ep": parallel.expert_parallel,
                "etp": parallel.expert_tp},
        with_optimizer=False, architecture=src.arch_name,
        extra={"converted_from": os.path.abspath(hf_dir), "hf_class": src.hf_class,
               "role": role, "fresh_value_head": src.init_value_head})
    publish(tmp, os.path.abspath(out), meta)
    return meta
