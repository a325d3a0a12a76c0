"""Per-rank functions for the PPO role tests (importable, so `spawn` can run them)."""

from __future__ import annotations

import dataclasses

import torch

from megarlhf.convert.mcore_io import CheckpointReader
from megarlhf.data.sequences import SequenceBatch
from megarlhf.engine.checkpoint import engine_from_checkpoint, save_checkpoint
from megarlhf.engine.optim import OptimConfig
from megarlhf.parallel.mesh import ParallelConfig, init_mesh
from megarlhf.roles.batching import Batching
from megarlhf.roles.policy import PolicyLossConfig, PolicyRole
from megarlhf.roles.value import ValueLossConfig, ValueRole

# No warmup: the one step under test must move the weights. Adam's first step is
# lr * g / (|g| + eps): with the default eps 1e-8 a weight whose gradient cancels to ~1e-9
# moves by up to lr on fp32 summation-order noise alone (seen: 3e-5 apart between layouts
# with the ptx term). eps 1e-6 keeps such weights' updates proportional to their gradient;
# scale errors still show in grad_norm and in every weight with a real gradient.
OPTIM = OptimConfig(lr=1e-3, weight_decay=0.01, clip_grad=1.0, adam_eps=1e-6)


def experience_batch(vocab_size: int, *, rows: int, seed: int, columns: int = 18,
                     samples: int = 1) -> SequenceBatch:
    """Left-padded prompts (3-8 tokens) + right-padded responses (1 to columns - 8 tokens),
    T = columns; each run of `samples` rows has one prompt (a prompt's samples)."""
    g = torch.Generator().manual_seed(seed)
    prompt_cols, response_cols = 8, columns - 8
    tokens = torch.randint(1, vocab_size, (rows, prompt_cols + response_cols), generator=g)
    attention = torch.zeros_like(tokens)
    response = torch.zeros_like(tokens)
    for r in range(rows):
        p = int(torch.randint(3, prompt_cols + 1, (), generator=g))
        n = int(torch.randint(1, response_cols + 1, (), generator=g))
        if r % samples:
            p = int(attention[r - 1, :prompt_cols].sum())
            tokens[r, :prompt_cols] = tokens[r - 1, :prompt_cols]
        attention[r, prompt_cols - p:prompt_cols + n] = 1
        response[r, prompt_cols:prompt_cols + n] = 1
    tokens = torch.where(attention.bool(), tokens, 0)
    return SequenceBatch(tokens=tokens, attention_mask=attention, response_mask=response)


def _engine(ckpt: str, parallel: ParallelConfig, mesh, optim, recompute: str = "none"):
    return engine_from_checkpoint(ckpt, parallel, mesh, optim, on_gpu=False,
                                  recompute=recompute)


def ppo_step(actor_ckpt: str, critic_ckpt: str, parallel: ParallelConfig, batch: SequenceBatch,
             batching: Batching, save_dir: str, seed: int = 7,
             recompute: tuple[str, str] = ("none", "none")) -> dict:
    """One actor and one critic PPO update on `batch`, colocated on one mesh. As in a PPO
    worker, the mesh has no sequence parallelism, the models have `parallel`'s; `recompute`:
    the actor's and the critic's."""
    mesh = init_mesh(dataclasses.replace(parallel, sequence_parallel=False))
    actor = PolicyRole(_engine(actor_ckpt, parallel, mesh, OPTIM, recompute[0]),
                       batching=batching,
                       loss=PolicyLossConfig(clip_eps=0.2, dual_clip=3.0, entropy_coef=0.01,
                                             ptx_coef=0.5))
    critic = ValueRole(_engine(critic_ckpt, parallel, mesh, OPTIM, recompute[1]),
                       batching=batching, loss=ValueLossConfig(clip_eps=0.1))
    g = torch.Generator().manual_seed(seed)
    logp, entropy = actor.logprobs(batch, with_entropy=True)
    # Old logprobs off by up to +-0.5 so that some ratios leave the clip range.
    old_logp = logp + (torch.rand(logp.shape, generator=g) - 0.5)
    advantages = torch.randn(logp.shape, generator=g)
    # Pretraining rows of the same shape, trained on their "response" tokens.
    ptx = experience_batch(actor.engine.spec.model.vocab_size, rows=batch.shape[0],
                           seed=seed + 100, columns=batch.shape[1])
    actor_step, actor_metrics = actor.train_step(batch, old_logp, advantages, ptx)
    values = critic.values(batch)
    # Old values off by up to +-0.2 so that the 0.1 value clip takes effect on some tokens.
    old_values = values + (torch.rand(values.shape, generator=g) - 0.5) * 0.4
    returns = values + torch.randn(values.shape, generator=g) * 0.3
    critic_step, critic_metrics = critic.train_step(batch, old_values, returns)
    result = {
        "logp": logp, "entropy": entropy, "values": values,
        "logp_after": actor.logprobs(batch), "values_after": critic.values(batch),
        "actor": {**actor_metrics, "loss": actor_step.loss, "grad_norm": actor_step.grad_norm},
        "critic": {**critic_metrics, "loss": critic_step.loss,
                   "grad_norm": critic_step.grad_norm},
    }
    save_checkpoint(f"{save_dir}/actor", actor.engine, mesh, with_optimizer=False)
    save_checkpoint(f"{save_dir}/critic", critic.engine, mesh, with_optimizer=False)
    return result


def one_pass_update(actor_ckpt: str, parallel: ParallelConfig, batch: SequenceBatch,
                    batching: Batching, seed: int = 5) -> dict:
    """The actor's one update of a batch (with an entropy bonus and a ptx term), its old
    logprobs once from a separate pass and once from the update pass itself, by two actors
    built from one checkpoint. The second first refuses its step in `check_logprobs` (its
    weights must not move), then accepts it; the logprobs and entropy each check got."""
    mesh = init_mesh(parallel)
    loss = PolicyLossConfig(entropy_coef=0.01, ptx_coef=0.5)
    g = torch.Generator().manual_seed(seed)
    advantages = torch.randn(batch.shape, generator=g)
    separate, one_pass = (PolicyRole(_engine(actor_ckpt, parallel, mesh, OPTIM),
                                     batching=batching, loss=loss) for _ in range(2))
    ptx = experience_batch(separate.engine.spec.model.vocab_size, rows=batch.shape[0],
                           seed=seed + 100, columns=batch.shape[1])
    logp, entropy = separate.logprobs(batch, with_entropy=True)
    step, metrics = separate.train_step(batch, logp, advantages, ptx)
    checked = []
    refused, _ = one_pass.train_step(batch, None, advantages, ptx, check_logprobs=lambda *t: (
        checked.append(t), False)[1])
    unmoved = one_pass.logprobs(batch)
    accepted, one_pass_metrics = one_pass.train_step(
        batch, None, advantages, ptx, check_logprobs=lambda *t: (checked.append(t), True)[1])
    return {"logp": logp, "entropy": entropy, "checked": checked, "unmoved": unmoved,
            "refused_skipped": refused.skipped,
            "separate": {**metrics, "loss": step.loss, "grad_norm": step.grad_norm},
            "one_pass": {**one_pass_metrics, "loss": accepted.loss,
                         "grad_norm": accepted.grad_norm},
            "separate_after": separate.logprobs(batch), "one_pass_after": one_pass.logprobs(batch)}


def reward_scores(ckpt: str, parallel: ParallelConfig, batch: SequenceBatch,
                  batching: Batching = Batching()) -> torch.Tensor:
    mesh = init_mesh(parallel)
    return ValueRole(_engine(ckpt, parallel, mesh, None), batching=batching).scores(batch)


def unpadded_scores(ckpt: str, batch: SequenceBatch) -> list[float]:
    """Each row alone, padding stripped, at TP1: the score at its last token."""
    parallel = ParallelConfig()
    mesh = init_mesh(parallel)
    role = ValueRole(_engine(ckpt, parallel, mesh, None))
    scores = []
    for tokens, mask in zip(batch.tokens, batch.attention_mask):
        real = tokens[mask.bool()][None]
        response = torch.zeros_like(real)
        response[0, -1] = 1
        single = SequenceBatch(tokens=real, attention_mask=torch.ones_like(real),
                               response_mask=response)
        scores.append(float(role.scores(single)[0]))
    return scores


def checkpoint_tensors(path: str) -> dict[str, torch.Tensor]:
    reader = CheckpointReader(path)
    keys = [k for k in reader.metadata.state_dict_metadata if reader.shape(k) is not None]
    return dict(zip(keys, reader.read([(k, (0,) * len(reader.shape(k)), reader.shape(k))
                                       for k in keys])))


def policy_terms(actor_ckpt: str, parallel: ParallelConfig, batch: SequenceBatch,
                 batching: Batching, loss: PolicyLossConfig, seed: int = 11) -> dict:
    """One actor update with every term of the loss on: the policy gradient on random old
    logprobs and per-row advantages, weighted by random rollout-correction weights in [0, 2),
    and a KL loss (coefficient 0.1) to a random reference. Returns the inputs, the metrics
    and the logprobs after the step."""
    mesh = init_mesh(parallel)
    actor = PolicyRole(_engine(actor_ckpt, parallel, mesh, OPTIM),
                       batching=batching, loss=loss)
    g = torch.Generator().manual_seed(seed)
    logp = actor.logprobs(batch)
    shape = logp.shape
    inputs = {"logp": logp, "old_logp": logp + (torch.rand(shape, generator=g) - 0.5) * 0.4,
              "advantages": torch.randn(shape[0], 1, generator=g).expand(shape).contiguous(),
              "ref_logp": logp + (torch.rand(shape, generator=g) - 0.5),
              "is_weight": torch.rand(shape, generator=g) * 2}
    step, metrics = actor.train_step(batch, inputs["old_logp"], inputs["advantages"],
                                     ref_logp=inputs["ref_logp"], kl_coef=0.1,
                                     is_weight=inputs["is_weight"])
    return {**inputs, "metrics": {**metrics, "loss": step.loss, "grad_norm": step.grad_norm},
            "logp_after": actor.logprobs(batch)}


def logprobs_with_and_without_the_cut(actor_ckpt: str, parallel: ParallelConfig,
                                      batch: SequenceBatch, batchings: dict) -> dict:
    """Per batching (name -> Batching): the actor's logprobs and entropy as PolicyRole
    computes them (the LM head at the positions response tokens read only), and the same
    from micro-batches that name no positions (logits everywhere), with the LM head's input
    rows of each pass counted."""
    from megatron.core.models.gpt import GPTModel

    from megarlhf.engine.schedule import Loss
    from megarlhf.roles.batching import microbatches, to_global

    mesh = init_mesh(dataclasses.replace(parallel, sequence_parallel=False))
    engine = _engine(actor_ckpt, parallel, mesh, None)
    head_rows = []
    last = engine.chunks[-1]
    while not isinstance(last, GPTModel):
        last = last.module
    if last.post_process:
        last.output_layer.register_forward_hook(
            lambda module, args, out: head_rows.append(args[0].shape[0] * args[0].shape[1]))
    out = {}
    for name, batching in batchings.items():
        actor = PolicyRole(engine, batching=batching)
        head_rows.clear()
        cut = actor.logprobs(batch, with_entropy=True)
        rows_cut = sum(head_rows)
        head_rows.clear()

        def keep(mb, per_position, actor=actor):
            logp, entropy = actor._logp_entropy(mb, per_position)
            return torch.zeros(()), torch.ones((), dtype=torch.int), {"logp": logp,
                                                                     "entropy": entropy}

        mbs = microbatches(engine, batching, batch)
        outputs = engine.forward(mbs, Loss(closure=keep, per_position=actor._per_position))
        whole = tuple(to_global(mbs, outputs, key, batch.shape, engine)
                      for key in ("logp", "entropy"))
        out[name] = {"cut": cut, "whole": whole, "head_rows_cut": rows_cut,
                     "head_rows_whole": sum(head_rows), "pp_last": mesh.pp_rank == mesh.pp - 1}
    return out


def masked_rows_update(actor_ckpt: str, critic_ckpt: str, batch: SequenceBatch,
                       dropped: list[int], seed: int = 5) -> dict:
    """The actor and the critic updated twice from the same weights: on `batch` with the rows
    `dropped` out of the loss mask (samples whose score failed; their advantages and returns
    huge, so any leak shows), and on the batch that never had those rows. Returns each run's
    grad norms and the logprobs and values after the step on the kept rows."""
    mesh = init_mesh(ParallelConfig())
    g = torch.Generator().manual_seed(seed)
    kept = [r for r in range(batch.shape[0]) if r not in dropped]
    advantages = torch.randn(batch.shape, generator=g)
    advantages[dropped] = 1e3
    returns = torch.randn(batch.shape, generator=g)
    returns[dropped] = -1e3
    loss_mask = batch.response_mask.clone()
    loss_mask[dropped] = 0
    sub = SequenceBatch(tokens=batch.tokens[kept], attention_mask=batch.attention_mask[kept],
                        response_mask=batch.response_mask[kept])
    out = {}
    # (inputs' rows of the batch, the rows compared after the step)
    for name, part, rows, pick, mask in (("masked", batch, slice(None), kept, loss_mask),
                                         ("without", sub, kept, slice(None), None)):
        actor = PolicyRole(_engine(actor_ckpt, ParallelConfig(), mesh, OPTIM),
                           loss=PolicyLossConfig(aggregation="seq_mean_token_mean"))
        critic = ValueRole(_engine(critic_ckpt, ParallelConfig(), mesh, OPTIM))
        old_logp, old_values = actor.logprobs(part), critic.values(part)
        step, _ = actor.train_step(part, old_logp - 0.1, advantages[rows], loss_mask=mask)
        vstep, _ = critic.train_step(part, old_values, returns[rows], loss_mask=mask)
        out[name] = {"actor_grad_norm": step.grad_norm, "critic_grad_norm": vstep.grad_norm,
                     "logp_after": actor.logprobs(part)[pick],
                     "values_after": critic.values(part)[pick]}
    return out
