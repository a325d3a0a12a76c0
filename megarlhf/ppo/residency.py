"""What each role of a colocated worker keeps on the device in each phase of the loop.

The colocated ranks hold every role, but a phase uses only some of them. With the run's
offload switches on (PPOConfig.offload_params / offload_grads / offload_optimizer), a phase
starts by moving the switched kinds of state of every role it does not use off the device
(megarlhf/engine/offload.py) and the ones it uses back:

    phase        on the device (of what is switched to offload)
    rollout      nothing: the engine has the device
    experience   one role's weights at a time, as the roles' forward passes take turns
    train        actor and critic: weights, grads, optimizer (their steps alternate)
    sync         the actor's weights (the bridge reads them)
    checkpoint   actor and critic: weights and optimizer (saved or loaded)

The rollout engine sleeps (PPOConfig.rollout_sleep) from the first phase after the step's
rollouts to the weight sync, which wakes it in stages; that part is the worker's (it
owns the engine). A colocated judge engine (reward_judge) sleeps outside its own calls
(a phase `judge`, holding what rollout holds); its weights are counted in each phase's
bytes, so with rollout_sleep the judge phase shows them on top of what the roles hold and
no other phase does.
"""

from __future__ import annotations

from megarlhf.engine.offload import KINDS, Offloader

Needs = dict[str, tuple[str, ...]]
"""role -> the kinds of its state a phase needs on the device."""

ROLLOUT: Needs = {}
TRAIN: Needs = {"actor": KINDS, "critic": KINDS}
SYNC: Needs = {"actor": ("params",)}
CHECKPOINT: Needs = {"actor": ("params", "optimizer"), "critic": ("params", "optimizer")}


HELD: dict[str, Needs] = {"rollout": ROLLOUT, "train": TRAIN, "sync": SYNC,
                          "checkpoint": CHECKPOINT}
"""What each phase holds for its whole length (experience loads roles in turn instead)."""


def forward_of(role: str) -> Needs:
    """An experience forward pass of `role`."""
    return {role: ("params",)}


class Residency:
    def __init__(self, models: dict, *, params: bool, grads: bool, optimizer: bool,
                 engines: dict | None = None):
        """`models`: role -> its TrainEngine; the flags: which kinds are offloaded;
        `engines`: name -> an inference engine whose device_bytes() count too (the judge's;
        it sleeps and wakes on its own)."""
        self.switched = frozenset(k for k, on in zip(KINDS, (params, grads, optimizer)) if on)
        self.roles = {role: Offloader(engine) for role, engine in models.items()}
        self.engines = engines or {}
        self.peaks: dict[str, int] = {}
        """phase -> the most bytes of the roles' state on the device in it (the metrics'
        memory/<phase>_state_mib; the planner's resident terms)."""

    def keep(self, phase: str, needs: Needs) -> None:
        """Have exactly `needs` on the device of what is switched to offload, for `phase`:
        first the rest goes off, then the needed comes back, so the two never add up."""
        for role, offloader in self.roles.items():
            wanted = set(needs.get(role, ()))
            offloader.offload((self.switched & set(offloader.kinds())) - wanted)
        for role, offloader in self.roles.items():
            offloader.reload(needs.get(role, ()))
        self.note(phase)

    def note(self, phase: str) -> None:
        """Count what is on the device now as `phase`'s (also after a phase that creates
        state: the first step's Adam moments, a checkpoint's loaded optimizer)."""
        held = sum(offloader.device_bytes() for offloader in self.roles.values()) + \
            sum(engine.device_bytes() for engine in self.engines.values())
        self.peaks[phase] = max(self.peaks.get(phase, 0), held)

    def take_peaks(self) -> dict[str, int]:
        peaks, self.peaks = self.peaks, {}
        return peaks
