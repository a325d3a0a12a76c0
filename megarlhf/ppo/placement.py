"""Where the PPO roles run, and which ranks each phase of the loop goes to.

- colocated: one group of `nproc` ranks holds every role: actor, ref, critic, reward and the
  rollout engine, fed by the bridge inside each rank.
- disaggregated: a group per role set, each with a torch.distributed world and Megatron mesh of
  its own: actor (trains; the weight source; with it the teacher, in its layout), critic (PPO
  only), ref+reward (frozen inference), each `nproc` ranks at TP x PP; with teacher_nproc
  the teacher (every teacher of the run) on `teacher_nproc` ranks of its own at
  layout.teacher's TP x PP instead of in the actor's group; `rollout_nproc`
  rollout ranks (engines of config.rollout_tp consecutive ranks) that all receive the actor's
  weights over the bridge's channel, each engine rank loading its own shard; and with
  reward_judge `judge_nproc` judge ranks (engines of config.judge_tp ranks, their weights
  the judge's own, never synced).

The loop calls the same phases either way. A phase goes to every group holding a role it
needs, all at once, and then waits for all of them: disaggregated, the actor's and ref's
logprobs, the critic's values, the reward model's scores and the teachers' logprobs on ranks
of their own are computed concurrently, and so are the actor and critic updates.

Disaggregated, a rollout engine that dies or hangs while the engines generate costs only the
rollout group: it is started again, the channel reopened and the weights synced whole, and
the call made again (`rollout`, `_restart_engines`); any other lost rank takes the whole
restart from the latest checkpoint (controller).
"""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from typing import TYPE_CHECKING, Callable

from megarlhf.data.sequences import SequenceBatch
from megarlhf.errors import RunFault
from megarlhf.ppo.config import PPOConfig
from megarlhf.ppo.groups import WorkerError, WorkerLost
from megarlhf.ppo.layout import group_specs
from megarlhf.ppo.worker_api import WorkerAPI
from megarlhf.rollout.engine import Completion, SamplingParams
from megarlhf.rollout.sizing import EngineSize
from megarlhf.roles.policy import PolicyInputs

if TYPE_CHECKING:
    import torch

ROLLOUT, EXPERIENCE, TRAIN, SYNC, JUDGE = (frozenset({"rollout"}),
                                           frozenset({"actor", "ref", "critic", "reward",
                                                      "teacher"}),
                                           frozenset({"actor", "critic"}),
                                           frozenset({"actor", "rollout"}),
                                           frozenset({"judge"}))
"""The roles each phase needs: the groups holding any of them take part."""
_NOTHING = object()


def backend(config: PPOConfig):
    """The worker groups' backend for a run: made once and kept across its restarts (a Ray
    runtime started here is not started again after a fault); shut it down at the run's end,
    once no thread waits on a call."""
    total_ranks = sum(s.nproc for s in group_specs(config))
    if config.worker_group == "ray":
        from megarlhf.ppo.ray_group import RayBackend

        return RayBackend(total_ranks)
    from megarlhf.ppo.groups import LocalBackend

    return LocalBackend(total_ranks, collective_timeout_s=config.collective_timeout_s)


class Placement:
    """The controller's handle on every group of the job. Starting it starts every rank (all
    groups at once), connects the weight channel and loads the rollout engines' weights."""

    def __init__(self, config: PPOConfig, groups_backend,
                 engine_sizes: dict[str, EngineSize] | None = None, *,
                 after_fault: bool = False):
        """`groups_backend`: the run's (`backend`); `engine_sizes`: the vLLM engines' sizes,
        "rollout" (from `preflight`) and "judge" (RunInputs.judge_size); `after_fault`:
        started again after a fault (Ray: a cluster without room for the groups for
        restart_wait_s stops the run, for a requeue)."""
        self.config = config
        self.specs = group_specs(config)
        self._all_roles = set().union(*(spec.roles for spec in self.specs))
        self._thread = threading.local()
        self._failed = False
        self._durations: dict[tuple, list[float]] = {}  # per phase (_run): last wall times
        self._backend = groups_backend
        self._engine_sizes = engine_sizes or {}
        self._groups = []
        # Engine-only recovery (_restart_engines): the restarts so far, their events not yet
        # logged, and whether the actor trained since the engines' last sync (conservative
        # both ways: set before a train call, cleared after a sync).
        self.engine_restarts, self._engine_events, self._weights_moved = 0, [], False
        # Taken by shutdown to close, and by a restart to put its new group in (a rollout
        # group restarting in a thread is either stopped by the shutdown or not started) and
        # to count itself.
        self._groups_lock, self._closed = threading.Lock(), False
        # A group serves one call at a time. With asynchronous rollouts the engines' calls (and
        # the reward model's scores of their samples) run in a thread beside the training
        # phases: a call takes the locks of its groups, in group order (no deadlock), for as
        # long as it runs.
        self._locks = [threading.Lock() for _ in self.specs]
        # After a fault all groups together wait at most restart_wait_s for room.
        room_until = time.monotonic() + config.restart_wait_s if after_fault else None
        try:
            for spec in self.specs:
                self._groups.append(self._backend.group(
                    spec.name, spec.nproc, (config, spec, engine_sizes or {}),
                    room_wait_s=None if room_until is None
                    else max(0.0, room_until - time.monotonic())))
            self._wait([g.starting for g in self._groups])
            with self._holding(self._chosen(SYNC)):
                self._connect()
        except BaseException:
            self._failed = True
            self.shutdown()
            raise

    # -- the loop's phases -------------------------------------------------------------------

    def rollout(self, prompts: list[list[int]], params: SamplingParams,
                keys: list[int] | None = None) -> list[Completion]:
        """params.n completions per prompt, a prompt's consecutive; `keys`: see
        WorkerAPI.generate (PPOWorker.generate). Disaggregated, an engine lost in the call is
        restarted alone and the call made again (`_restart_engines`); lost again in it, the
        same way, the run stops."""
        generate = functools.partial(self._run, WorkerAPI.generate, ROLLOUT, prompts, params,
                                     keys)
        try:
            (completions,), seconds = generate(recoverable=True)
        except WorkerLost as fault:
            self._restart_engines(fault)
            try:
                (completions,), seconds = generate()
            except WorkerLost as again:
                if again.kind != fault.kind:  # another fault: the whole restart judges it
                    raise
                raise RunFault(f"{again.cause}; not restarted: the same fault again after the "
                               f"rollout engines' restart, so it comes from the run "
                               f"itself") from again
        self.busy["rollout"] = self.busy.get("rollout", 0.0) + seconds  # a step may take rounds
        return completions

    def judge(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """The judge engine's completions (reward_judge), one per prompt (PPOWorker.judge)."""
        (completions,), seconds = self._run(WorkerAPI.judge, JUDGE, prompts, params)
        self.busy["judge"] = self.busy.get("judge", 0.0) + seconds
        return completions

    def experience(self, batch: SequenceBatch, roles: frozenset[str],
                   routing: torch.Tensor | None = None) -> dict:
        """What `roles` (of EXPERIENCE) add to the batch: logp, entropy (and routing_moved,
        with a `routing`) from the actor, ref_logp, values (critic), rm_scores (reward)."""
        parts, seconds = self._run(WorkerAPI.experience, roles, batch, roles,
                                   for_actor=routing)
        self.busy["experience"] = self.busy.get("experience", 0.0) + seconds
        return {key: value for part in parts for key, value in part.items()}

    def train(self, batch: SequenceBatch, old_logp, advantages, old_values, returns,
              loss_mask, policy: PolicyInputs) -> tuple[list[dict], dict[str, torch.Tensor]]:
        """Metrics of every optimizer step (actor and critic steps of one mini-batch merged),
        and with `old_logp` None what the actor's update pass gives in its place
        (PPOWorker.train)."""
        self._weights_moved = True  # before the call: no engine restart may see it unset
        parts, self.busy["train"] = self._run(WorkerAPI.train, TRAIN, batch, old_logp,
                                              advantages, old_values, returns, loss_mask,
                                              for_actor=policy)
        steps = [{k: v for step in steps for k, v in step.items()}
                 for steps in zip(*(metrics for metrics, _ in parts))]
        return steps, {k: v for _, own in parts for k, v in own.items()}

    def sync(self, whole: bool = True) -> dict[str, float]:
        """The weight sync; what it moved (sync_mode=delta: the rollout group's sync/*).
        `whole`: every bucket whole (sync_mode=delta sends the rest as deltas); a phase of
        its own for deadlines, so a whole sync is not judged by the deltas before it."""
        parts, self.busy["sync"] = self._run(WorkerAPI.sync_weights, SYNC, whole)
        self._weights_moved = False
        return {k: v for part in parts for k, v in part.items()}

    def profile(self, step: int) -> None:
        """Profile every rank's phases (megarlhf/profiling.py) until take_profile."""
        self._run(WorkerAPI.profile, self._all_roles, step)

    def take_profile(self) -> dict[str, dict[str, dict]]:
        """group -> phase -> its rank 0's table of the profiled step (every rank wrote its
        traces)."""
        parts, _ = self._run(WorkerAPI.take_profile, self._all_roles)
        return {spec.name: tables for spec, tables in zip(self.specs, parts)}

    def take_memory(self) -> dict[str, int]:
        """phase -> the most bytes of model state on a device in it since the last call (each
        group's rank 0; the phases of all groups)."""
        parts, _ = self._run(WorkerAPI.take_memory, self._all_roles)
        return {phase: max(p.get(phase, 0) for p in parts)
                for phase in sorted({phase for p in parts for phase in p})}

    @property
    def busy(self) -> dict[str, float]:
        """Worker-side seconds of each phase's latest call (its slowest rank), of the calls
        this thread made (a rollout drawn ahead in a thread counts apart)."""
        if not hasattr(self._thread, "busy"):
            self._thread.busy = {}
        return self._thread.busy

    def take_busy(self) -> dict[str, float]:
        busy, self._thread.busy = self.busy, {}
        return busy

    # -- checkpoints -------------------------------------------------------------------------

    def save(self, directory: str) -> None:
        self._run(WorkerAPI.save, self._all_roles, directory)

    def load(self, directory: str) -> None:
        self._run(WorkerAPI.load, self._all_roles, directory)
        self.sync()

    def abandon(self) -> None:
        """Shut down without waiting for the ranks: a call is still running on some."""
        self._failed = True

    def shutdown(self) -> None:
        """Stop every rank, all groups at once; after a failure without waiting (the others
        may be stuck in a collective with the failed rank and would never answer). The
        backend stays up for the run's next start (and a thread may still be reading a
        killed rank's answer)."""
        with self._groups_lock:
            self._closed = True
        deadline = time.monotonic() + (0 if self._failed else 30)
        for group in self._groups:
            group.stop()
        for group in self._groups:
            group.join(deadline)
        self._groups = []

    # -- the rollout engines' recovery -------------------------------------------------------

    def take_engine_restarts(self) -> list[dict]:
        """The "engine_restart" events since the last call (cause, seconds), for the log."""
        with self._groups_lock:
            events, self._engine_events = self._engine_events, []
        return events

    def _connect(self) -> None:
        """Open the weight channel (disaggregated; the actor's rank 0 hosts it, at a port free
        now) and sync the weights whole. The caller holds the SYNC groups' locks."""
        if self.config.placement == "disaggregated":
            host, port = self._groups[0].address()
            self._call(WorkerAPI.open_channel, SYNC, (host, port))
        self._call(WorkerAPI.sync_weights, SYNC, (True,))

    def _restart_engines(self, fault: WorkerLost) -> None:
        """After `fault` in a call only the rollout group took part in (disaggregated): kill
        that group (its other ranks may wait in a collective with the lost one), start it
        again, reopen the channel on both sides and sync the weights whole (a delta sync's
        bases died with the engines). The trainer's groups keep their state. Only while the
        engines can get the very weights they held (the actor has not trained since their
        last sync) and max_engine_restarts allows; else `fault` goes on to the whole restart
        from the latest checkpoint."""
        start = time.monotonic()
        with self._holding(self._chosen(SYNC)):
            # Ray's actors and vLLM engines are not restarted alone: those paths are untested
            # (the docstring of max_engine_restarts says so).
            if self.config.placement != "disaggregated" or self.config.worker_group != "local" \
                    or self.config.rollout_backend != "megatron" or self._weights_moved or \
                    self.engine_restarts >= self.config.max_engine_restarts:
                self._failed = True
                raise fault
            (i,) = self._chosen(ROLLOUT)
            spec = self.specs[i]
            with self._groups_lock:
                if self._closed:  # the run is stopping (a fault in another thread)
                    raise fault
                self._groups[i].join(time.monotonic())  # kills what is left of it
                group = self._groups[i] = self._backend.group(
                    spec.name, spec.nproc, (self.config, spec, self._engine_sizes),
                    room_wait_s=self.config.restart_wait_s)
            self._wait([group.starting])
            with self._groups_lock:  # a shutdown meanwhile emptied the groups
                if self._closed:
                    raise fault
            self._connect()
            with self._groups_lock:
                self.engine_restarts += 1
                self._engine_events.append({
                    "event": "engine_restart", "engine_restart": self.engine_restarts,
                    "cause": fault.cause, "seconds": round(time.monotonic() - start, 3)})

    # -- plumbing ----------------------------------------------------------------------------

    def _run(self, method: Callable, roles: set[str], *args, for_actor=_NOTHING,
             recoverable: bool = False) -> tuple[list, float]:
        """`method(*args)` (a WorkerAPI method) on every rank of the groups holding any of
        `roles`, concurrently: (rank 0's result per group, the slowest rank's seconds in it).
        `for_actor`: a last argument the actor's group gets and the others get as None (they
        would only receive and drop it: an expert routing is gigabytes at scale).
        `recoverable`: a lost rank leaves the other groups' ranks to a clean shutdown (the
        caller may restart its group alone)."""
        with self._holding(self._chosen(roles)):
            return self._call(method, roles, args, for_actor, recoverable)

    def _chosen(self, roles: set[str]) -> list[int]:
        """The groups holding any of `roles`, in group order."""
        return [i for i, spec in enumerate(self.specs) if spec.roles & roles]

    def _holding(self, chosen: list[int]) -> contextlib.ExitStack:
        """The `chosen` groups' locks, taken in group order (no deadlock)."""
        held = contextlib.ExitStack()
        for i in chosen:
            held.enter_context(self._locks[i])
        return held

    def _call(self, method: Callable, roles: set[str], args: tuple, for_actor=_NOTHING,
              recoverable: bool = False) -> tuple[list, float]:
        """`_run` for a caller holding the groups' locks."""
        chosen = self._chosen(roles)
        phase = (method.__name__, frozenset(roles), call_size(args))
        try:
            calls = [self._groups[i].async_call(
                method.__name__, *args, *self._last_argument(i, for_actor)) for i in chosen]
        except (WorkerError, KeyboardInterrupt) as e:  # stop the others now, as _wait does
            self._fail(e, recoverable)
            raise
        per_call = self._wait(calls, phase, recoverable)
        return ([ranks[0][0] for ranks in per_call],
                max(seconds for ranks in per_call for _, seconds in ranks))

    def _fail(self, error: BaseException, recoverable: bool) -> None:
        """A call failed with `error`: the shutdown will not wait for the ranks (some may be
        stuck in a collective with a failed one), unless a caller may restart the lost
        rank's group alone."""
        if not (recoverable and isinstance(error, WorkerLost)):
            self._failed = True

    def _last_argument(self, group: int, for_actor) -> tuple:
        if for_actor is _NOTHING:
            return ()
        return (for_actor if "actor" in self.specs[group].roles else None,)

    def _wait(self, calls: list, phase: tuple | None = None,
              recoverable: bool = False) -> list[list[tuple]]:
        """The calls' answers, within the deadline of `phase` (see call_size) from its recent
        durations; None (the start-up, which loads every model): the backend's own limit.
        `recoverable`: see _run."""
        start = time.monotonic()
        recent = self._durations.setdefault(phase, []) if phase else []
        deadline = phase_deadline(recent, self.config.phase_timeout_factor,
                                  self.config.phase_timeout_min_s) if phase else None
        try:
            out = self._backend.wait_all(calls, deadline)
        except (WorkerError, KeyboardInterrupt) as e:  # Ctrl-C: stop now, not after the phase
            self._fail(e, recoverable)
            raise
        recent[:] = [*recent[-(RECENT_PHASES - 1):], time.monotonic() - start]
        return out


RECENT_PHASES = 5


def call_size(args: tuple) -> tuple:
    """What sizes a call's work: the rows of its batch and list arguments, a rollout's
    samples per prompt and token limit. A phase's deadline comes from the durations of calls
    of its own method, roles and size only, so a validation rollout over many prompts, a
    multi-turn episode's short later turns and the reward-only scoring of a round each keep
    their own (a size not seen yet gets the backend's limit)."""
    size = []
    for arg in args:
        if isinstance(arg, (list, tuple)):
            size.append(len(arg))
        elif isinstance(arg, SequenceBatch):
            size.append(arg.tokens.shape[0])
        elif isinstance(arg, SamplingParams):
            size.append((arg.n, arg.max_new_tokens))
        elif isinstance(arg, bool):  # a weight sync whole or as deltas
            size.append(arg)
    return tuple(size)


FIRST_CALL_S = 1800.0
"""The deadline of a phase's first call (of its kind and size), whose time includes one-off
work (compiling, allocating, the first of a new shape)."""


def phase_deadline(recent: list[float], factor: float, floor_s: float) -> float:
    """Seconds a phase may take given its last durations: `factor` x the longest of them, at
    least `floor_s`; FIRST_CALL_S before its first run."""
    return max(factor * max(recent), floor_s) if recent else FIRST_CALL_S
