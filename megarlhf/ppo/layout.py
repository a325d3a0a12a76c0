"""Which worker groups a PPO run has: the roles each holds, its rank count and its mesh.
Read by the placement (to start them), the workers (to know their roles) and the planner
(to size them); it imports none of them."""

from __future__ import annotations

import dataclasses

from megarlhf.parallel.mesh import ParallelConfig
from megarlhf.ppo.config import PPOConfig


@dataclasses.dataclass(frozen=True)
class GroupSpec:
    name: str
    roles: frozenset[str]
    nproc: int
    parallel: ParallelConfig
    """This group's mesh (TP x PP x CP; DP = nproc / (TP x PP x CP)), without sequence parallelism:
    that is each role's own (PPOConfig.parallel_of), and the colocated Megatron rollout engine
    on the same mesh generates without it."""


def group_specs(config: PPOConfig) -> tuple[GroupSpec, ...]:
    """The groups, each at its roles' layout (the config checked that roles sharing a group
    have one)."""
    critic = {"critic"} if "critic" in config.roles else set()
    reward = {"reward"} if config.reward_model else set()
    def mesh(role: str) -> ParallelConfig:
        return dataclasses.replace(config.parallel_of(role), sequence_parallel=False)

    actor = mesh("actor")
    judge = {"judge"} if config.reward_judge is not None else set()
    # "teacher": every teacher of the run (PPOConfig.teachers), each a model of the group.
    teacher = {"teacher"} if config.teachers else set()
    if config.placement == "colocated":
        roles = frozenset({"actor", "ref", "rollout"} | critic | reward | judge | teacher)
        return (GroupSpec("colocated", roles, config.nproc, actor),)
    # With the actor's LoRA adapters the reference is the actor with them off: in its group.
    # Without ranks of its own (teacher_nproc) the teacher runs in the actor's layout
    # (PPOConfig.parallel_of): in its group too.
    ref = {"ref"}
    own_teacher = teacher if config.teacher_nproc is not None else set()
    actor_roles = frozenset({"actor"} | (ref if config.reference_is_actor_base else set())
                            | (teacher - own_teacher))
    groups = [GroupSpec("+".join(sorted(actor_roles)), actor_roles, config.nproc, actor)]
    if critic:
        groups.append(GroupSpec("critic", frozenset(critic), config.nproc,
                                mesh("critic")))
    inference = frozenset((ref - actor_roles) | reward)
    if inference:
        groups.append(GroupSpec("+".join(sorted(inference)), inference, config.nproc,
                                mesh(min(inference))))
    if own_teacher:
        groups.append(GroupSpec("teacher", frozenset(own_teacher), config.teacher_nproc,
                                mesh("teacher")))
    groups.append(GroupSpec("rollout", frozenset({"rollout"}), config.rollout_nproc,
                            ParallelConfig(tensor_parallel=config.rollout_tp)))
    if judge:  # engines of its own, like the rollout group's
        groups.append(GroupSpec("judge", frozenset(judge), config.judge_nproc,
                                ParallelConfig(tensor_parallel=config.judge_tp)))
    return tuple(groups)
