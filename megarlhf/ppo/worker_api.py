"""What the controller calls on the ranks of a worker group: `PPOWorker` implements these
methods with these signatures (tests/test_ppo.py checks), and `Placement` names a call by one
of them (`WorkerAPI.train`), so a misspelt or removed call fails where it is written. Only the
name travels to the ranks. Kept apart from the worker so the controller's process does not
import what the ranks need (megatron-core, the rollout engines)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from megarlhf.data.sequences import SequenceBatch
    from megarlhf.roles.policy import PolicyInputs
    from megarlhf.rollout.engine import Completion, SamplingParams


class WorkerAPI(Protocol):
    def open_channel(self, host: str, port: int) -> None: ...

    def generate(self, prompts: list[list[int]], params: SamplingParams,
                 keys: list[int] | None) -> list[Completion]: ...

    def judge(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]: ...

    def experience(self, batch: SequenceBatch, roles: frozenset[str],
                   routing: torch.Tensor | None) -> dict[str, torch.Tensor]: ...

    def train(self, batch: SequenceBatch, old_logp: torch.Tensor | None,
              advantages: torch.Tensor, old_values: torch.Tensor | None,
              returns: torch.Tensor | None, loss_mask: torch.Tensor,
              policy: PolicyInputs | None) -> tuple[list[dict], dict[str, torch.Tensor]]: ...

    def sync_weights(self, whole: bool) -> dict[str, float]: ...

    def profile(self, step: int) -> None: ...

    def take_profile(self) -> dict[str, dict]: ...

    def take_memory(self) -> dict[str, int]: ...

    def save(self, directory: str) -> None: ...

    def load(self, directory: str) -> None: ...
