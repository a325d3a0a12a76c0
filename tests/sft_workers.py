"""Per-rank functions for the SFT / RM tests (importable, so `spawn` can run them)."""

from __future__ import annotations

import torch

from megarlhf.data.config import DataConfig, DatasetSource
from megarlhf.data.dataset import load_examples
from megarlhf.data.packing import one_per_row, pack, sft_batch
from megarlhf.data.tokenizer import load_tokenizer
from megarlhf.engine.checkpoint import load_checkpoint, read_meta
from megarlhf.engine.losses import lm_loss
from megarlhf.engine.optim import OptimConfig
from megarlhf.engine.train import TrainEngine
from megarlhf.models.config import ModelConfig
from megarlhf.models.gpt import model_spec
from megarlhf.parallel.mesh import ParallelConfig, init_mesh


def packed_vs_unpacked(ckpt: str, tokenizer: str, data: str, *, documents: int,
                       max_length: int, optim: OptimConfig) -> dict:
    """The same documents as packed rows and as one padded row each, at TP1 from the same
    weights: loss and token count before, gradient norm of, and loss after one step."""
    parallel = ParallelConfig()
    mesh = init_mesh(parallel)
    tok = load_tokenizer(tokenizer)
    cfg = DataConfig(train=DatasetSource(path=data), tokenizer=tokenizer,
                     max_length=max_length)
    examples = load_examples(cfg, "sft", tok).train[:documents]
    model = ModelConfig.from_dict(read_meta(ckpt)["model"])
    loss_fn = lm_loss(mesh, model.vocab_size)
    out = {}
    for name, rows in (("packed", pack(examples, max_length)),
                       ("unpacked", one_per_row(examples))):
        engine = TrainEngine(model_spec(model, parallel, layer_spec="local", on_gpu=False),
                             mesh, optim)
        load_checkpoint(ckpt, engine, with_optimizer=False)
        batch = sft_batch(rows, tok.pad_id)
        before = engine.global_sums(engine.forward([batch], loss_fn))
        step = engine.train_step([batch], loss_fn)
        after = engine.global_sums(engine.forward([batch], loss_fn))
        out[name] = {"rows": len(rows), "width": batch["tokens"].shape[1],
                     "tokens": before["num_tokens"],
                     "loss": before["loss_sum"] / before["num_tokens"],
                     "grad_norm": step.grad_norm,
                     "loss_after": after["loss_sum"] / after["num_tokens"]}
    return out


def peft_adapter_outputs(base: str, adapter: str, parallel: ParallelConfig,
                         tokens: torch.Tensor) -> torch.Tensor:
    """Logits of the base checkpoint with a PEFT adapter loaded as an SFT run starts
    (lora.from_peft), at `parallel`."""
    from megarlhf.convert.verify import engine_outputs
    from megarlhf.models.lora import LoraConfig
    from megarlhf.sft.config import ModelSource
    from megarlhf.sft.model import init_weights, model_config, new_engine

    source = ModelSource(checkpoint=base, layer_spec="local",
                         lora=LoraConfig(from_peft=adapter))
    mesh = init_mesh(parallel)
    engine = new_engine(source, model_config(source, value_head=False), parallel, mesh,
                        OptimConfig(), value_head=False)
    init_weights(source, engine)
    return engine_outputs(engine, tokens)
