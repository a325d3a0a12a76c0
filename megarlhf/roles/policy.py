"""Actor and reference: per-token logprobs (and entropy) of given sequences, and the actor's
update (policy-gradient loss, entropy bonus, KL loss, ptx loss) through the pipeline
schedules."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from megarlhf.data.sequences import SequenceBatch
from megarlhf.engine.train import StepMetrics, TrainEngine
from megarlhf.engine.schedule import Loss
from megarlhf.parallel.vocab import vocab_parallel_logprobs_and_entropy
from megarlhf.rl.kl import KL_ESTIMATORS, kl_penalty
from megarlhf.rl.losses import aggregate, policy_loss
from megarlhf.rollout.gap import GapGuard
from megarlhf.roles.batching import Batching, about_token, microbatches, to_global


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicyLossConfig:
    """The actor's loss: the policy-gradient term (megarlhf.rl.losses.policy_loss, weighted per
    token by the rollout correction when given), minus the entropy bonus, plus the KL loss
    against the reference and the ptx loss."""

    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    """Upper clip range (DAPO's clip-higher); None = clip_eps."""
    dual_clip: float | None = None
    """Dual-clip constant (> 1) for negative advantages; None = off."""
    ratio_level: str = "token"
    """'token' (PPO) or 'sequence' (GSPO) importance ratios."""
    kind: str = "clip"
    """'clip' (PPO's clipped surrogate) or 'cispo' (clipped stop-gradient weights)."""
    log_ratio_clamp: float | None = None
    """Clamp on the log importance ratio before exp (None: none)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus subtracted from the loss."""
    aggregation: str = "token_mean"
    """How token losses become one loss (megarlhf.rl.losses.aggregate)."""
    aggregation_norm: float | None = None
    """seq_mean_token_sum_norm's constant (tokens); required by it, refused by the others."""
    kl_estimator: str = "k3"
    """KL loss estimator (k1, k2, k3); its coefficient comes with each train step, so an
    adaptive controller can steer it."""
    kl_clamp: float | None = None
    """Clamp on the per-token KL estimate (None: none)."""
    ptx_coef: float = 0.0
    """Weight of the pretraining (ptx) loss, the token-mean NLL of a ptx batch, added to the
    PPO loss (InstructGPT's PPO-ptx). Needs a ptx batch in train_step when > 0."""

    def __post_init__(self):
        aggregate(torch.zeros(1, 1), torch.ones(1, 1), self.aggregation,
                  norm=self.aggregation_norm)  # the mode, and its norm
        policy_loss(*(torch.zeros(1, 1),) * 4, clip_eps=self.clip_eps,  # the loss options
                    clip_eps_high=self.clip_eps_high, dual_clip=self.dual_clip,
                    ratio_level=self.ratio_level, kind=self.kind)
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(f"unknown kl_estimator {self.kl_estimator!r}; choose one of "
                             f"{sorted(KL_ESTIMATORS)}")
        for name in ("kl_clamp", "log_ratio_clamp"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0 or None, got {getattr(self, name)}")
        if self.entropy_coef < 0:
            raise ValueError(f"entropy_coef must be >= 0, got {self.entropy_coef}")
        if self.ptx_coef < 0:
            raise ValueError(f"ptx_coef must be >= 0, got {self.ptx_coef}")

    def aggregate(self, loss_BT: torch.Tensor, mask_BT: torch.Tensor):
        return aggregate(loss_BT, mask_BT, self.aggregation, norm=self.aggregation_norm)


@dataclasses.dataclass(frozen=True)
class PolicyInputs:
    """The actor loss's inputs besides sequences, old logprobs and advantages, for a global
    batch: the reference's logprobs and the KL coefficient of the KL loss (kl_coef 0: no KL
    term), and the rollout correction's per-token weights (None: 1)."""

    ref_logp: torch.Tensor | None = None
    kl_coef: float = 0.0
    is_weight: torch.Tensor | None = None
    routing: torch.Tensor | None = None
    """[B, T, layers, k]: the rollout engine's expert routing to replay (None: the routers
    choose)."""
    gap_guard: GapGuard | None = None
    """With the update pass's own logprobs as the old ones: what they are held to before the
    optimizer steps (the worker applies it; not a train_step argument)."""

    def rows(self, rows: slice) -> dict:
        """train_step's keyword arguments for the mini-batch `rows`."""
        return {"ref_logp": _part(self.ref_logp, rows), "kl_coef": self.kl_coef,
                "is_weight": _part(self.is_weight, rows), "routing": _part(self.routing, rows)}


def _part(t: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if t is None else t[rows]


def ptx_scale(cfg: PolicyLossConfig, loss_mask: torch.Tensor, ptx: SequenceBatch | None
              ) -> float:
    """ptx_coef * D_ppo / D_ptx: the factor on a ptx micro-batch's NLL sum that makes the
    engine's sum(numerators) / D_ppo equal PPO loss + ptx_coef * token-mean NLL (D_ppo over
    the PPO batch's counted tokens, `loss_mask`)."""
    if (ptx is not None) != (cfg.ptx_coef > 0):
        raise ValueError("a ptx batch and ptx_coef > 0 go together: got ptx_coef="
                         f"{cfg.ptx_coef} and {'a' if ptx is not None else 'no'} ptx batch")
    if ptx is None:
        return 0.0
    ppo_den = int(cfg.aggregate(torch.zeros(loss_mask.shape), loss_mask)[1])
    return cfg.ptx_coef * ppo_den / int(ptx.response_mask.sum())


_STEP_METRICS = ("loss_sum", "num_tokens", "pg_sum", "kl_sum", "tokens", "clipped",
                 "approx_kl", "entropy", "ptx_sum", "ptx_tokens", "positions")


def _step_metrics(**given: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every micro-batch reports the same keys (the engine sums them); PPO and ptx
    micro-batches each fill theirs and leave the others 0."""
    zero = torch.zeros((), device=next(iter(given.values())).device)
    return {key: given.get(key, zero) for key in _STEP_METRICS}


class PolicyRole:
    """Actor (with an optimizer) or reference (without) over one TrainEngine."""

    def __init__(self, engine: TrainEngine, *, batching: Batching = Batching(),
                 loss: PolicyLossConfig | None = None):
        if engine.spec.value_head:
            raise ValueError("a policy role needs an LM; build its engine with "
                             "model_spec(..., value_head=False)")
        self.engine, self.batching = engine, batching
        self.loss = loss or PolicyLossConfig()
        self._vocab_size = engine.spec.model.vocab_size

    # The logits [R, L, V] in the micro-batch's layout (batching.py) become log p(label) and
    # the entropy per position [R, L, 2] (on this rank's positions under context
    # parallelism); the closures give per-token quantities [b, W] in the global batch's rows
    # and columns from those. The micro-batches name the positions their response tokens
    # read: the model makes logits [R, n, V] there only, and the other positions hold 0.
    def _per_position(self, inputs, logits_RLV):
        mesh = self.engine.mesh
        labels, positions = inputs["labels"], inputs.get("logit_positions")
        out = torch.stack(vocab_parallel_logprobs_and_entropy(
            logits_RLV, labels if positions is None else labels[:, positions],
            tp_group=mesh.tp_group, vocab_start=mesh.tp_rank * logits_RLV.shape[-1],
            vocab_size=self._vocab_size), dim=-1)
        if positions is None:
            return out
        whole = out.new_zeros(*labels.shape, 2)
        whole[:, positions] = out
        return whole

    @staticmethod
    def _logp_entropy(mb, per_position_RL2):
        return about_token(mb, per_position_RL2[..., 0]), about_token(mb, per_position_RL2[..., 1])

    def logprobs(self, batch: SequenceBatch, *, with_entropy: bool = False,
                 routing: torch.Tensor | None = None):
        """log p(token_t | tokens_<t) [B, T] (and entropy [B, T]) at the response tokens
        (response_mask; 0 elsewhere: the LM head runs only where they read it) on every rank;
        with `routing` [B, T, layers, k] the tokens go through those experts."""

        def keep(mb, per_position):
            # 0 off the response tokens whatever the layout (batched rows share columns)
            logp, entropy = (torch.where(mb["response_mask"].bool(), t.detach(), 0)
                             for t in self._logp_entropy(mb, per_position))
            zero = torch.zeros((), device=logp.device)
            return zero, torch.ones((), dtype=torch.int), {"logp": logp, "entropy": entropy}

        mbs = microbatches(self.engine, self.batching, batch, routing, response_logits=True,
                           response_mask=batch.response_mask)
        out = self.engine.forward(mbs, Loss(closure=keep, per_position=self._per_position))
        logp = to_global(mbs, out, "logp", batch.shape, self.engine)
        return (logp, to_global(mbs, out, "entropy", batch.shape, self.engine)) \
            if with_entropy else logp

    def routing_moved(self) -> float:
        """Of the last pass given a routing, the fraction of its token routings the routers
        would have chosen otherwise (collective; see RoutingReplay.moved_fraction)."""
        return self.engine.routing_replay.moved_fraction(self.engine.mesh.device)

    def train_step(self, batch: SequenceBatch, old_logp: torch.Tensor | None,
                   advantages: torch.Tensor, ptx: SequenceBatch | None = None, *,
                   ref_logp: torch.Tensor | None = None, kl_coef: float = 0.0,
                   is_weight: torch.Tensor | None = None, routing: torch.Tensor | None = None,
                   loss_mask: torch.Tensor | None = None,
                   check_logprobs: Callable[[torch.Tensor, torch.Tensor], bool] | None = None
                   ) -> tuple[StepMetrics, dict[str, float]]:
        """One optimizer step over the global batch of

            policy-gradient loss (per token, times `is_weight` when given: the rollout
            correction) - entropy_coef * entropy + kl_coef * KL(actor || ref)

        each aggregated as `self.loss.aggregation` says (the KL term, estimator
        `kl_estimator`, needs `ref_logp` when kl_coef > 0), plus `ptx_coef` times the
        token-mean NLL of `ptx` (tokens under its response_mask). With `routing` [B, T,
        layers, k] the batch's tokens go through those experts (ptx tokens are routed freely).
        `loss_mask` [B, T]: the response tokens the loss counts (None: all of them); a row
        without any (a sample whose score failed) is computed but neither trained nor counted,
        so the step equals one over a batch that never had it.

        The PPO and ptx terms are means over different token sets, and the engine divides the
        sum of all micro-batches' numerators by one global denominator. Both denominators are
        known up front (every rank holds the global batches), so ptx micro-batches contribute
        `ptx_coef * D_ppo / D_ptx * NLL_sum` with denominator 0: the step's loss is then
        PPO + ptx_coef * ptx however the batches are split.

        `old_logp` None: the pass's own logprobs, detached, are the old ones (the step is the
        batch's only update, so a separate pass would compute the same); `check_logprobs`
        then gets them and the entropy, [B, T] over the global batch (0 off the response
        tokens), on every rank after the backward pass, and the optimizer steps only if it
        returns True.

        Returns the engine's step metrics and global means: policy loss, KL loss (the
        aggregated KL estimate, before kl_coef), clip fraction, approximate KL (k3, to
        pi_old) and entropy over response tokens, the model positions the pass ran per real
        token of `batch` (padding raises it above 1, shared prompts lower it) (and ptx loss;
        with a `routing`, the share of its token routings the routers would have chosen
        otherwise).
        """
        cfg = self.loss
        if kl_coef < 0 or (kl_coef > 0 and ref_logp is None):
            raise ValueError(f"kl_coef must be >= 0 and needs ref_logp when > 0, got "
                             f"{kl_coef} and {'no ' if ref_logp is None else ''}ref_logp")
        counted = batch.response_mask if loss_mask is None else loss_mask
        scale = ptx_scale(cfg, counted, ptx)

        def ptx_loss(mb, per_position):
            mask = mb["response_mask"]
            nll = -(self._logp_entropy(mb, per_position)[0] * mask).sum()
            no_tokens = mask.bool().sum() * 0
            return scale * nll, no_tokens.to(torch.int), _step_metrics(
                loss_sum=(scale * nll).detach(), num_tokens=no_tokens, ptx_sum=nll.detach(),
                ptx_tokens=mask.bool().sum())

        def ppo_loss(mb, per_position):
            logp, entropy = self._logp_entropy(mb, per_position)
            mask = mb["loss_mask"]
            m = mask.bool()
            old = logp.detach() if old_logp is None else mb["old_logp"]
            pg_BT, stats = policy_loss(logp, old, mb["advantages"], mask,
                                       clip_eps=cfg.clip_eps, clip_eps_high=cfg.clip_eps_high,
                                       dual_clip=cfg.dual_clip, ratio_level=cfg.ratio_level,
                                       kind=cfg.kind, log_ratio_clamp=cfg.log_ratio_clamp)
            pg_BT = pg_BT * mb["is_weight"]
            loss_BT = pg_BT - cfg.entropy_coef * entropy
            kl_num = torch.zeros((), device=logp.device)
            if kl_coef > 0:
                kl_BT = kl_penalty(logp, mb["ref_logp"], cfg.kl_estimator, clamp=cfg.kl_clamp)
                loss_BT = loss_BT + kl_coef * kl_BT
                kl_num, _ = cfg.aggregate(kl_BT.detach(), mask)
            num, den = cfg.aggregate(loss_BT, mask)
            pg_num, _ = cfg.aggregate(pg_BT.detach(), mask)
            # With no old_logp given, the pass's own, for check_logprobs (0 off the response
            # tokens, as `logprobs` gives them: every response token, trained or not).
            r = mb["response_mask"].bool()
            own = {} if old_logp is not None else {
                "token_logp": torch.where(r, logp.detach(), 0),
                "token_entropy": torch.where(r, entropy.detach(), 0)}
            return num, den.to(torch.int), {**_step_metrics(
                loss_sum=num.detach().clone(), num_tokens=den.detach().clone(),
                pg_sum=pg_num, kl_sum=kl_num, tokens=m.sum(),
                clipped=stats["clipped"][m].sum(), approx_kl=stats["approx_kl"][m].sum(),
                entropy=entropy.detach()[m].sum(),
                positions=torch.tensor(mb["tokens"].numel(), device=logp.device)), **own}

        def loss_fn(mb, per_position):
            return (ptx_loss if bool(mb["is_ptx"][0, 0]) else ppo_loss)(mb, per_position)

        per_token = {"advantages": advantages,
                     "ref_logp": torch.zeros(batch.shape) if ref_logp is None else ref_logp,
                     "is_weight": torch.ones(batch.shape) if is_weight is None else is_weight}
        if old_logp is not None:
            per_token["old_logp"] = old_logp
        ppo_mbs = mbs = self._microbatches(batch, counted, is_ptx=False, routing=routing,
                                           **per_token)
        if ptx is not None:
            free = None if routing is None else torch.full(
                (*ptx.shape, *routing.shape[2:]), -1, dtype=routing.dtype)
            mbs = mbs + self._microbatches(ptx, ptx.response_mask, is_ptx=True, routing=free,
                                           **{k: torch.zeros(ptx.shape) for k in per_token})

        def before_step(outputs):  # the PPO micro-batches' outputs come first, in order
            ppo = outputs[:len(ppo_mbs)]
            return check_logprobs(*(to_global(ppo_mbs, ppo, key, batch.shape, self.engine)
                                    for key in ("token_logp", "token_entropy")))

        step = self.engine.train_step(
            mbs, Loss(closure=loss_fn, per_position=self._per_position),
            before_step=before_step if old_logp is None and check_logprobs else None)
        s = step.sums
        metrics = {"policy_loss": s["pg_sum"] / s["num_tokens"],
                   "kl_loss": s["kl_sum"] / s["num_tokens"],
                   "clip_fraction": s["clipped"] / s["tokens"],
                   "approx_kl": s["approx_kl"] / s["tokens"],
                   "entropy": s["entropy"] / s["tokens"],
                   "positions_per_token": s["positions"] / int(batch.attention_mask.sum())}
        if ptx is not None:
            metrics["ptx_loss"] = s["ptx_sum"] / s["ptx_tokens"]
        if routing is not None:
            metrics["routing_replay_moved"] = self.routing_moved()
        return step, metrics

    def _microbatches(self, batch: SequenceBatch, loss_mask: torch.Tensor, *, is_ptx: bool,
                      routing, **per_token: torch.Tensor):
        return microbatches(self.engine, self.batching, batch, routing, response_logits=True,
                            response_mask=batch.response_mask.float(),
                            loss_mask=loss_mask.float(),
                            is_ptx=torch.full(batch.shape, float(is_ptx)),
                            **{k: v.float() for k, v in per_token.items()})
