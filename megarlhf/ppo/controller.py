"""The PPO loop: one controller drives the worker groups, top to bottom.

    prompts -> rollout (n per prompt) and rewards (megarlhf/ppo/rollouts.py; with dynamic
    sampling, more rounds; one_step_off: drawn during the step before; fully_async: taken
    from a buffer the engines fill without waiting, ppo/streaming.py) -> experience
    (logprobs, ref logprobs, values) -> advantages ->
    policy inputs (KL loss, rollout correction) -> PPO epochs (actor, critic) -> weight sync
    -> metrics -> checkpoint
    (and, with val_prompts, validation before the first step, every val_every steps and after
    the last)

The controller holds no model: it samples prompts, scores responses with the reward
function (in its worker processes), computes advantages (cheap tensor math on the global
batch) and logs; every model computation is a collective call on the workers. The
`Placement` sends each phase to the groups that hold its roles (one group colocated, several
at once disaggregated), so this loop is the same for both placements. A local rank that dies
or hangs sends the run back to its latest checkpoint (`max_restarts`, `_run_restarting`);
disaggregated, a rollout engine lost while it generates is restarted alone
(`max_engine_restarts`, Placement.rollout).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import math
import time

import torch

from megarlhf import profiling
from megarlhf.errors import RunFault
from megarlhf.envs.episodes import Episode
from megarlhf.metrics import MetricsLog
from megarlhf.ppo import checkpoints, gap_probe, placement, rollouts, run_dir, streaming
from megarlhf.ppo.config import PPOConfig
from megarlhf.ppo.data import PromptSampler
from megarlhf.ppo.groups import WorkerLost
from megarlhf.ppo.inputs import RunInputs, read_inputs
from megarlhf.ppo.metrics import CONSOLE_KEYS, step_metrics
from megarlhf.ppo.placement import EXPERIENCE, Placement
from megarlhf.ppo.sources import TEACHER_LOGP
from megarlhf.rewards.calls import Sample
from megarlhf.rl import (
    AdaptiveKLController, FixedKLController, critic_free_advantages, distillation_advantages,
    gae, kl_penalty, kl_shaped_rewards, masked_whiten, trained_samples,
)
from megarlhf.rl.advantages import GROUP_ESTIMATORS
from megarlhf.rl.shaping import clip_rewards
from megarlhf.rl.correction import rollout_correction
from megarlhf.roles.policy import PolicyInputs
from megarlhf.rollout.experience import response_tokens_where, rollout_batch
from megarlhf.rollout.gap import GapGuard, LogprobGap, check_gap, logprob_gap


_log = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """A reward or loss was NaN/Inf and the run's nan_policy is 'stop'."""


def run(config: PPOConfig) -> list[dict]:
    """Run (or resume) the job; returns the metrics of the steps this call ran. Everything
    that can be checked without the models' weights is checked before any rank starts."""
    config.check_paths()
    claim = run_dir.Claim(config.out_dir)
    try:
        return _run_restarting(config)
    finally:
        claim.release()


def _run_restarting(config: PPOConfig) -> list[dict]:
    """The run, and after a lost worker the run again from its latest checkpoint (up to
    max_restarts times within restart_window_steps): the metrics of every step it finished,
    each once."""
    history: list[dict] = []
    restarts: list[dict] = []
    groups_backend = placement.backend(config)  # kept across restarts (Ray stays up)
    try:
        while True:
            try:
                _run_claimed(config, groups_backend, history, restarts)
                return history
            except WorkerLost as fault:
                restarts.append(_restart_point(config, fault, restarts, history))
                time.sleep(config.restart_backoff)
    finally:
        groups_backend.shutdown()


def _restart_point(config: PPOConfig, fault: WorkerLost, restarts: list[dict],
                   history: list[dict]) -> dict:
    """The restart event for `fault` (history cut back to its checkpoint), or RunFault when
    there is no checkpoint to restart from, no restart left within restart_window_steps, or
    the last restart's fault came back in the same step."""
    saved, done = checkpoints.of_run(config.out_dir).completed(), len(restarts)
    cause, failed = fault.cause, fault.step
    window = [r["failed_step"] for r in restarts
              if r["failed_step"] > failed - config.restart_window_steps]
    if not saved:
        reason = "no checkpoint to restart from yet (save_every sets how often one is saved)"
    elif len(window) >= config.max_restarts:
        reason = (f"max_restarts={config.max_restarts} reached within restart_window_steps="
                  f"{config.restart_window_steps}" + (f" (after faults in steps "
                                                      f"{', '.join(map(str, window))})"
                                                      if window else ""))
    elif restarts and (restarts[-1]["kind"], restarts[-1]["failed_step"]) == (fault.kind, failed):
        reason = "the same fault in the same step again, so it comes from the run itself"
    else:
        reason = None
    if reason:
        raise RunFault(f"{cause}; not restarted: {reason}; last checkpoint: "
                       f"{saved[-1][1] if saved else 'none'}") from fault
    step, path = saved[-1]
    history[:] = [m for m in history if m["step"] <= step]
    return {"event": "restart", "restart": done + 1, "cause": cause, "failed_step": failed,
            "resumed_from": path, "resumed_step": step, "fault_time": time.time(),
            "kind": fault.kind}


def _run_claimed(config: PPOConfig, groups_backend, history: list[dict],
                 restarts: list[dict]) -> None:
    checkpoints.of_run(config.out_dir).remove_leftovers()
    data = read_inputs(config)
    try:
        _train(config, groups_backend, data, history, restarts)
    finally:
        data.close()


def _train(config: PPOConfig, groups_backend, data: RunInputs, history: list[dict],
           restarts: list[dict]) -> None:
    """Steps from the latest checkpoint (or the start) to the end, appending each step's
    metrics to `history`; `restarts`: the restart events so far (the last one brought this
    call about, if any)."""
    sampler = PromptSampler(data.train, seed=config.seed)
    inputs = run_dir.run_inputs(config, data.train)
    latest, state = run_dir.resume_point(config, inputs)
    start = state["step"] if state is not None else 0
    kept = checkpoints.read_pending(latest, state, rollouts.settings(config)) if state else None
    kl_coef = config.options.kl_coef
    kl_ctl = (AdaptiveKLController(kl_coef, config.kl_target, config.kl_horizon)
              if config.kl_target is not None else FixedKLController(kl_coef))
    log = MetricsLog(config.out_dir, name="ppo", steps=config.steps, resumed_step=start,
                     console_keys=CONSOLE_KEYS, tensorboard=config.tensorboard,
                     wandb_project=config.wandb_project, run_config={**dataclasses.asdict(config),
                                              "resolved": dataclasses.asdict(config.options)})
    current = start + 1  # the step a fault interrupts (in its start-up, or its save)
    try:
        if restarts:
            _log_restart(log, restarts[-1])
        log.write({"event": "data", **data.report}, echo=False)
        sizes = {name: size for name, size in (("rollout", data.checked.engine_size),
                                                ("judge", data.judge_size)) if size}
        sizes.update(data.checked.teacher_sizes)
        workers, steps = Placement(config, groups_backend, sizes,
                                   after_fault=bool(restarts)), None
        try:
            # After a resume the engine holds the checkpoint's weights (loading syncs them).
            stream = streaming.Stream if config.resolved_rollout_mode == "fully_async" \
                else rollouts.Rollouts
            steps = stream(config, data, workers, sampler, weight_version=start, pending=kept)
            if state is not None:
                workers.load(latest)
                sampler.load_state_dict(state["sampler"])
                kl_ctl.load_state_dict(state["kl"])
                log.note(f"resumed from {latest} (step {start})")
            elif data.val:
                with steps.idle():  # the reward function's pool serves one thread
                    log.write({"step": 0, **validate(config, data, workers, 0, log)})
            for step in range(start + 1, config.steps + 1):
                current = step
                metrics = ppo_step(config, data, workers, steps, kl_ctl, step, log)
                if restarts:
                    metrics["fault/restarts"] = len(restarts)
                if data.val and (step == config.steps or
                                 (config.val_every and step % config.val_every == 0)):
                    with steps.idle():  # as above
                        metrics.update(validate(config, data, workers, step, log))
                _log_engine_restarts(log, workers, step, metrics)
                history.append(metrics)
                log.write(metrics)
                if step == config.steps or (config.save_every and
                                            step % config.save_every == 0):
                    position, pending = steps.snapshot()
                    checkpoints.save(config, workers, step, {
                        "step": step, "sampler": position,
                        "kl": kl_ctl.state_dict(), "inputs": inputs}, pending=pending,
                        settings=rollouts.settings(config))
            steps.stop()
        finally:
            if steps is not None and steps.drawing():  # its ranks are busy drawing a rollout
                workers.abandon()
            workers.shutdown()
            if steps is not None:
                steps.close()  # the thread's call ends with the shutdown
    except WorkerLost as fault:
        fault.step = current
        raise
    finally:
        log.close()


def _log_restart(log: MetricsLog, restart: dict) -> None:
    """The restart event, once its run's log is open (seconds: from the fault to now)."""
    event = {k: v for k, v in restart.items() if k not in ("fault_time", "kind")}
    event["seconds"] = round(time.time() - restart["fault_time"], 3)
    log.write(event, echo=False)
    log.note(f"restart {event['restart']} after: {event['cause']} (in step "
             f"{event['failed_step']}); starting again from step {event['resumed_step']}")


def _log_engine_restarts(log: MetricsLog, workers: Placement, step: int,
                         metrics: dict) -> None:
    """The rollout engines' restarts since the last step (Placement.rollout): each an
    "engine_restart" event, and the count so far in the step's metrics."""
    for event in workers.take_engine_restarts():
        log.write({**event, "failed_step": step}, echo=False)
        log.note(f"engine restart {event['engine_restart']} after: {event['cause']} (in step "
                 f"{step}), {event['seconds']} s; the trainer kept its state")
    if workers.engine_restarts:
        metrics["fault/engine_restarts"] = workers.engine_restarts


def ppo_step(config: PPOConfig, data: RunInputs, workers: Placement,
             steps: rollouts.Rollouts | streaming.Stream, kl_ctl, step: int,
             log: MetricsLog) -> dict:
    o = config.options
    start = time.perf_counter()
    if config.profiles(step):
        workers.profile(step)
    log.phase("rollout")
    drawn = steps.take(step)  # one_step_off: the next step's starts beside this one
    lag = step - 1 - drawn.weight_version  # actor updates the sampling weights missed
    # Wall-clock bounds of experience + train, and of the rollout drawn beside them.
    span = {"time/learn_start": time.time()}
    episodes = drawn.episodes
    rollout = rollout_batch([list(p.ids) for p in drawn.prompts], drawn.completions,
                            rewards_at=[list(e.rewards_at) for e in episodes]
                            if episodes is not None else None)
    batch, score = rollout.sequences, drawn.score
    # A sample without a score (and, for a group estimator, every sample of a group left
    # with fewer than two scored) is computed on but not trained: `mask` is the response
    # tokens trained, and every statistic below is over them (or the scored samples).
    scored = drawn.scored()
    trained = trained_samples(scored, config.samples_per_prompt
                              if o.estimator in GROUP_ESTIMATORS else None)
    mask = batch.response_mask.float() * trained[:, None]
    failures = {"reward/failed_samples": float((~scored).sum()),
                "reward/failed_groups": float((~trained.view(-1, config.samples_per_prompt))
                                              .all(dim=1).sum())}
    # A rollout drawn ahead ran during the step before: its seconds are not this step's.
    timer = {} if drawn.busy else dict(drawn.seconds)

    log.phase("experience")
    t = time.perf_counter()
    routing = rollout.routing if config.routing_replay else None
    if config.routing_replay and routing is None:
        raise RuntimeError("routing_replay=true, but the rollout engine returned no routing")
    # The reward was scored with the rollout. With one_pass_old_logprobs the actor's update
    # pass gives its logprobs, and holds them to the gap guard before its optimizer step.
    one_pass = config.one_pass_old_logprobs
    roles = EXPERIENCE - {"reward"} - ({"actor"} if one_pass else set())
    exp = workers.experience(batch, roles, routing)
    own_teachers(config, exp, drawn.samples)
    # After the experience pass, which gives the teacher's logprobs the rows carry.
    teacher = response_values(exp["teacher_logp"], batch.response_mask) \
        if "teacher_logp" in exp else None
    log.samples(step, sample_rows(drawn.samples, score, config.log_samples, "train",
                                  episodes, drawn.judged, versions=drawn.versions,
                                  weight_version=drawn.weight_version, failed=drawn.failed,
                                  teacher_logp=teacher))
    # (after the log: the failures' reasons are in samples.jsonl)
    rollouts.check_failures(config, drawn.failed or [None] * len(scored), f"step {step}")
    gap = guard_gap(config, rollout.engine_logp, exp, batch, lag, step) \
        if not one_pass else None
    fresh = guard_fresh(config, rollout.engine_logp, exp, batch, drawn.versions, step) \
        if drawn.versions is not None and lag > 0 else {}
    timer["experience"], t = time.perf_counter() - t, time.perf_counter()

    values = exp.get("values")
    advantages, returns = compute_advantages(config, torch.where(trained, score, 0.0), exp,
                                             mask, kl_ctl.value, rollout.rewards_at, trained)
    policy, correction = PolicyInputs(routing=routing), {}
    if one_pass and lag == 0:
        policy = dataclasses.replace(policy, gap_guard=GapGuard(
            rollout.engine_logp, config.gap_limits, config.logprob_gap_policy))
    if o.kl_in == "loss" and kl_ctl.value > 0:
        policy = dataclasses.replace(policy, ref_logp=exp["ref_logp"], kl_coef=kl_ctl.value)
    if config.rollout_correction != "none":
        weights, correction = rollout_correction(
            exp["logp"], rollout.engine_logp, mask, mode=config.rollout_correction,
            level=config.rollout_correction_level, high=config.rollout_correction_threshold,
            low=config.rollout_correction_threshold_low)
        policy = dataclasses.replace(policy, is_weight=weights)

    train_metrics = []
    finite = _finite(score[scored], advantages)
    if not finite and config.nan_policy == "stop":
        raise NonFiniteError(f"step {step}: non-finite reward or advantage; set "
                             f"nan_policy=skip to skip such batches")
    if finite and int(mask.sum()) >= 2:  # (fewer: nothing to whiten or learn from)
        log.phase("train")
        train_metrics, own = workers.train(batch, None if one_pass else exp["logp"],
                                           advantages, values, returns, mask, policy)
        exp.update(own)
    if one_pass and "logp" not in exp:  # the step trained nothing: a pass for the metrics
        exp.update(workers.experience(batch, frozenset({"actor"}), routing))
    if gap is None:  # the update pass stepped only if this passes (or warns)
        gap = guard_gap(config, rollout.engine_logp, exp, batch, lag, step)
    losses = [v for m in train_metrics for k, v in m.items() if k.endswith("_loss")]
    if not all(math.isfinite(v) for v in losses) and config.nan_policy == "stop":
        raise NonFiniteError(f"step {step}: non-finite loss {losses}")
    timer["train"], t = time.perf_counter() - t, time.perf_counter()
    span["time/learn_end"] = time.time()

    log.phase("sync")
    steps.finish()  # the rollout drawn ahead: the engine must be idle for the sync
    timer["wait_rollout_ahead"], t = time.perf_counter() - t, time.perf_counter()
    # The weights of version `step`; with sync_mode=delta whole every delta_full_every
    # versions, so a resumed run syncs each version as a straight run does.
    with steps.paused():  # fully_async: between two of the engines' calls
        synced = workers.sync(whole=step % config.delta_full_every == 0)
        steps.synced(step)
    timer["sync"] = time.perf_counter() - t
    probed = {}
    if config.resolved_rollout_mode != "sync":  # the guard above saw older weights' samples
        t = time.perf_counter()
        probed, warning = gap_probe.probe(config, data, workers, drawn.prompts, step)
        timer["gap_probe"] = time.perf_counter() - t
        if warning:
            _log.warning(warning)
    if steps.overlap() is not None:  # when the next step's rollout ran (one_step_off)
        span["time/rollout_ahead_start"], span["time/rollout_ahead_end"] = steps.overlap()

    kl = float(((exp["logp"] - exp["ref_logp"]) * mask).sum() / mask.sum()) \
        if bool(mask.any()) else math.nan
    if math.isfinite(kl):  # a step that trained nothing does not steer the coefficient
        kl_ctl.update(kl, config.rows_per_step)
    # Without a reward source the zeros in `score` are no reward: reward/mean is NaN.
    rewarded = score[scored] if config.has_reward else score[:0]
    metrics = step_metrics(step=step, score=rewarded, exp=exp, mask=mask, values=values,
                           advantages=advantages, returns=returns, train=train_metrics,
                           gap=gap, kl=kl, kl_coef=kl_ctl.value, timer=timer,
                           skipped=not train_metrics,
                           response_tokens=float(batch.response_mask.sum()))
    # Samples that ended on a stop id rather than at max_new_tokens (a chat model that never
    # stops has a wrong stop id or template).
    stopped = sum(c.finish_reason == "stop" for c in drawn.completions) / len(drawn.completions)
    memory = {f"memory/{phase}_state_mib": nbytes / 2**20
              for phase, nbytes in workers.take_memory().items()}
    if config.profiles(step):
        log_profile(log, step, workers.take_profile())
    return {**metrics, **drawn.metrics, **failures, **correction, **probed, **synced, **fresh,
            "rollout/stopped_fraction": stopped,
            "rollout/weight_version": float(drawn.weight_version),
            "rollout/policy_lag": float(lag), **memory, **span,
            # The experience pass's share of the engine's routings the actor would have
            # chosen otherwise: ~0 on the engine's own weights, the drift since on older ones.
            **({"rollout/routing_replay_moved": float(exp["routing_moved"])}
               if "routing_moved" in exp else {}),
            **{f"time/ahead/{k}": v for k, v in drawn.seconds.items() if drawn.busy},
            **{f"time/worker_ahead/{k}": v for k, v in drawn.busy.items()},
            **overhead_metrics(time.perf_counter() - start, workers.take_busy())}


def guard_gap(config: PPOConfig, engine_logp: torch.Tensor, exp: dict, batch, lag: int,
              step: int) -> LogprobGap:
    """The step's engine/trainer logprob gap, held to the run's limits (check_gap: a stop
    raises, a warning is logged). Samples of older weights (async rollouts) differ by the
    updates since, which the rollout correction weighs: the guard holds for samples of the
    actor's own weights (lag 0: every synchronous step, the first asynchronous one, and the
    first after a resume)."""
    limits = config.gap_limits
    gap = logprob_gap(engine_logp, exp["logp"], batch.response_mask, limits.max)
    warning = check_gap(gap, limits, policy=config.logprob_gap_policy,
                        step=step) if lag == 0 else None
    if warning:
        _log.warning(warning)
    return gap


def guard_fresh(config: PPOConfig, engine_logp: torch.Tensor, exp: dict, batch,
                versions: list[list[int]], step: int) -> dict[str, float]:
    """fully_async: the guard on the tokens sampled with the actor's own weights (version
    step - 1) when the step also holds older ones, which a partial rollout may mix in one
    sample; rollout/fresh_logprob_gap_mean and _max over them (none: fresh_tokens 0)."""
    own = response_tokens_where(batch, [[v == step - 1 for v in sample] for sample in versions])
    if not bool(own.any()):
        return {"rollout/fresh_tokens": 0.0}
    limits = config.gap_limits
    gap = logprob_gap(engine_logp, exp["logp"], own, limits.max)
    warning = check_gap(gap, limits, policy=config.logprob_gap_policy, step=step)
    if warning:
        _log.warning(warning)
    return {"rollout/fresh_tokens": float(gap.num_tokens),
            "rollout/fresh_logprob_gap_mean": gap.mean_abs,
            "rollout/fresh_logprob_gap_max": gap.max_abs}


def log_profile(log: MetricsLog, step: int, groups: dict[str, dict[str, dict]]) -> None:
    """Each group's rank-0 tables of a profiled step: on the console, and as a "profile"
    event in metrics.jsonl."""
    for group, tables in groups.items():
        log.note(profiling.format_tables(step, f"group {group}, rank 0", tables))
        log.write({"event": "profile", "profiled_step": step, "group": group,
                   "phases": tables}, echo=False)


def compute_advantages(config: PPOConfig, score: torch.Tensor, exp: dict, mask: torch.Tensor,
                       kl_coef: float, rewards_at: torch.Tensor | None = None,
                       trained: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(advantages_BT, returns_BT or None) of the global batch for the run's algorithm
    (`config.options`); with kl_in='reward', the KL penalty (kl_coef x the estimator's
    per-token KL) is part of the reward. `rewards_at` [B, T]: the part of each score given
    at its own tokens (multi-turn episodes: each turn's reward at its last model token).
    `mask`: the tokens trained; `trained` [B] bool: the samples trained (None: all), the
    only members of a group estimator's groups (`score` must be finite everywhere).

    clip_reward clips what is trained, on every path: each reward given at a token and each
    sample's total (rl.shaping.clip_rewards).
    - gae (ppo): KL-shaped token rewards, GAE against the critic's values; the score's part
      in rewards_at is placed at its tokens, the rest at the last.
    - reinforce++ / reinforce++_baseline: KL-shaped token rewards, discounted returns and a
      whitening over the batch are the estimator itself (so whitened exactly once); the
      baseline variant clips its centred score again.
    - group estimators (grpo, rloo): a sample's summed KL penalty off its score (verl's
      in-reward KL), then the estimator (grpo with or without the group's std). These and
      reinforce++ score a sample as a whole (an episode's summed rewards at its end).
    - opd: none; the distillation term below is the whole advantage.
    Then whitening over the batch when whiten_advantages, then the distillation term
    (distill_coef > 0: distillation_advantages of the teacher's and the actor's old logprobs),
    so it is neither normalised nor whitened, and on `mask` only: never on an episode's
    observations (not response tokens) nor a sample not trained. Advantages and returns are
    0 off `mask`. The controller holds the whole batch, so batch statistics need no process
    group."""
    o = config.options
    zero = torch.zeros_like(mask)
    if int(mask.sum()) < 2:  # nothing to train (every sample failed, or all but a token)
        return zero, (zero if o.estimator == "gae" else None)
    placed = rewards_at if rewards_at is not None else zero
    if config.clip_reward is not None:
        score, placed = clip_rewards(score, placed, config.clip_reward)
    in_reward = kl_coef if o.kl_in == "reward" else 0.0
    kl = dict(kind=o.kl_estimator, kl_clamp=config.kl_clamp)
    # The logprobs matter only to a KL in the reward (one_pass_old_logprobs: the actor's are
    # not computed yet without one).
    logp, ref_logp = (exp["logp"], exp["ref_logp"]) if in_reward else (None, None)
    group = {"group_size": config.samples_per_prompt, "scored_B": trained}
    if o.estimator == "gae":
        rewards = kl_shaped_rewards(score - placed.sum(dim=1), logp, ref_logp,
                                    mask, kl_coef=in_reward, **kl) + placed
        advantages, returns = gae(rewards, exp["values"], mask, gamma=config.gamma,
                                  lam=config.lam)
    elif o.estimator == "opd":
        advantages, returns = zero, None
    elif o.estimator.startswith("reinforce++"):
        # The estimator clips the score it trains on again: for the baseline variant, the
        # centred score (OpenRLHF's reinforce_baseline); a no-op for the other.
        options = dict(logp_BT=logp, ref_logp_BT=ref_logp, kl_coef=in_reward,
                       kl_kind=kl.pop("kind"), gamma=config.gamma,
                       clip_reward=config.clip_reward, **kl)
        if o.estimator in GROUP_ESTIMATORS:
            options.update(group)
        advantages, returns = critic_free_advantages(o.estimator, score, mask, **options), None
    else:
        if in_reward:
            per_token = kl_penalty(exp["logp"], exp["ref_logp"], o.kl_estimator,
                                   clamp=config.kl_clamp)
            score = score - in_reward * torch.where(mask.bool(), per_token, 0.0).sum(dim=-1)
        options = dict(group)
        if o.estimator == "grpo":
            options["scale_by_std"] = o.advantage_std_norm
        advantages, returns = critic_free_advantages(o.estimator, score, mask, **options), None
    if o.whiten_advantages and not o.estimator.startswith("reinforce++"):
        advantages = masked_whiten(advantages, mask)
    if o.distill_coef:
        advantages = advantages + distillation_advantages(
            exp["teacher_logp"], exp["logp"], mask, coef=o.distill_coef,
            clip=config.distill_clip)
    # Rows left out of `mask` carry nothing that could reach a gradient (0, never NaN).
    advantages = torch.where(mask.bool(), advantages, 0.0)
    return advantages, (None if returns is None else torch.where(mask.bool(), returns, 0.0))


def overhead_metrics(wall: float, busy: dict[str, float]) -> dict[str, float]:
    """Where the step's wall time went: each phase's time inside the workers (its slowest
    rank), and the rest: the controller's own work, moving arguments and results, and
    waiting on the slowest rank to be asked and answer."""
    out = {f"time/worker/{phase}": seconds for phase, seconds in busy.items()}
    out["time/wall"] = wall
    out["time/controller_overhead"] = wall - sum(busy.values())
    return out


def validate(config: PPOConfig, data: RunInputs, workers: Placement, step: int,
             log: MetricsLog) -> dict[str, float]:
    """The policy's answers to the validation prompts (episodes, with an environment), scored
    by the reward function and the environment: greedy (val/reward_mean, and the
    environment's metrics as val/env/...), and with val_samples > 0 that many samples per
    prompt at the run's temperature (val/sampled_reward_mean, val/pass@k: the mean over
    prompts of the best of k rewards, pass@k for 0/1 rewards); each also per data source
    (val/<source>/...)."""
    log.phase("validation")
    t = time.perf_counter()
    # Greedy answers are logged as phase "val", sampled ones as "val_sampled": with
    # log_samples at least their number, every figure here can be recomputed from the log.
    runs = [("", 1, 0.0, "val")] + ([("sampled_", config.val_samples, config.temperature,
                                      "val_sampled")] if config.val_samples else [])
    out = {}
    for prefix, n, temperature, phase in runs:
        params = rollouts.sampling(config, data, n=n, temperature=temperature,
                                   seed=config.seed * 1_000_003 + step + 500_009)
        answers = rollouts.answer(data, workers, data.val, params)
        samples = data.samples(answers.prompts, answers.completions, answers.episodes)
        scored = rollouts.score_answers(config, data, workers, answers, samples, step,
                                        validation=True)
        score, metrics = scored.score, scored.metrics
        log.samples(step, sample_rows(samples, score, config.log_samples, phase,
                                      answers.episodes, failed=scored.failed))
        rollouts.check_failures(config, scored.failed, f"validation at step {step}")
        if not prefix:
            out["val/response_length"] = sum(len(c.token_ids) for c in answers.completions) / \
                len(answers.completions)
            out.update({f"val/{k}": v for k, v in metrics.items()
                        if k.startswith(("env/", "agent/"))})
        out[f"val/{prefix}failed_samples"] = float((~scored.scored()).sum())
        # Over the scored samples only: a failed one's NaN is left out of every figure.
        per_prompt = score.view(len(data.val), n)
        sources = [p.data_source for p in data.val]
        for source in [None] + sorted({s for s in sources if s is not None}):
            rows = per_prompt[[i for i, s in enumerate(sources) if source is None or s == source]]
            head = "val/" if source is None else f"val/{source}/"
            out[f"{head}{prefix}reward_mean"] = float(rows.nanmean())
            if prefix:  # the best of each prompt's scored samples, over prompts with any
                best = torch.where(rows.isnan(), -math.inf, rows).max(dim=1).values
                out[f"{head}pass@{n}"] = float(best[best > -math.inf].mean())
    out["time/validation"] = time.perf_counter() - t
    workers.take_busy()  # validation's rollouts are not the step's
    return out


def own_teachers(config: PPOConfig, exp: dict, samples: list[Sample]) -> None:
    """Replace each teacher's logprobs of the whole batch (TEACHER_LOGP + its name) with
    `teacher_logp`, each row's from its own teacher (PPOConfig.teacher_of its data source).
    A row without one is an error: the launch refuses such prompts, and a term no teacher
    scored must never train."""
    each = {key[len(TEACHER_LOGP):]: exp.pop(key) for key in list(exp)
            if key.startswith(TEACHER_LOGP)}
    if not each:
        return
    names = [config.teacher_of(s.data_source) for s in samples]
    untaught = sorted({str(s.data_source) for s, name in zip(samples, names) if name is None})
    if untaught:
        raise RuntimeError(f"rows of data source(s) {untaught} have no teacher (the launch "
                           f"should have refused them)")
    exp["teacher_logp"] = torch.stack([each[name][i] for i, name in enumerate(names)])


def sample_rows(samples: list[Sample], score: torch.Tensor, count: int, phase: str,
                episodes: list[Episode] | None = None,
                judged: list[dict] | None = None, *, weight_version: int | None = None,
                versions: list[list[int]] | None = None,
                failed: list[str | None] | None = None,
                teacher_logp: list[list[float]] | None = None) -> list[dict]:
    """`count` of the samples, spread over the batch, as samples.jsonl rows; an episode's
    with its turns in order (role, text, tokens, trained on or not); with the judge's text
    and score; with the weight version it was sampled under (fully_async: its oldest token's,
    and `token_versions`, [version, tokens] runs over its response); with the teacher's
    logprob of each of its response tokens (`teacher_logprobs`; an episode's model tokens
    only, in order) and, for a single-turn text row, its `prompt_ids` and `response_ids`
    (an episode's turns give their text and token counts, not ids). A sample without a
    score has reward null and `failed`, why."""
    picked = sorted({i * len(samples) // count for i in range(count)}) if count else []
    rows = []
    for i in picked:
        s = samples[i]
        row = {"phase": phase, "prompt": s.prompt if s.prompt is not None else s.prompt_ids,
               "response": s.response if s.response is not None else s.response_ids,
               "reward": float(score[i]), "ground_truth": s.ground_truth,
               "data_source": s.data_source}
        if failed is not None and failed[i] is not None:
            row.update(reward=None, failed=failed[i])
        if episodes is not None:
            row["turns"] = [dataclasses.asdict(part) for part in episodes[i].parts]
        if judged is not None:
            row.update(judged[i])
        if versions is not None:
            row["weight_version"] = min(versions[i])
            row["token_versions"] = [[v, len(list(run))]
                                     for v, run in itertools.groupby(versions[i])]
        elif weight_version is not None:
            row["weight_version"] = weight_version
        if teacher_logp is not None:
            row["teacher_logprobs"] = teacher_logp[i]
            if episodes is None and s.response is not None:
                # Text does not say which token each logprob scored: the ids do.
                row.update(prompt_ids=s.prompt_ids, response_ids=s.response_ids)
        rows.append(row)
    return rows


def response_values(values_BT: torch.Tensor, response_mask_BT: torch.Tensor
                    ) -> list[list[float]]:
    """Each row's values at its response tokens, in order (an episode's observations are
    not response tokens)."""
    return [row[keep.bool()].tolist() for row, keep in zip(values_BT, response_mask_BT)]


def _finite(*tensors: torch.Tensor) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def main(recipe: str, overrides: list[str]) -> None:
    from megarlhf.configio import load_config

    history = run(load_config(PPOConfig, recipe, overrides))
    print(json.dumps(history[-1] if history else {}, indent=1))
