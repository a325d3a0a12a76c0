"""RL math as pure tensor functions (no Ray, no global state): KL, advantages, losses, EMA."""

from megarlhf.rl.advantages import (
    CRITIC_FREE_ESTIMATORS, critic_free_advantages, distillation_advantages, gae,
    grpo_advantages, masked_whiten, reinforce_pp_advantages, reinforce_pp_baseline_advantages,
    rloo_advantages, trained_samples,
)
from megarlhf.rl.ema import ema_update
from megarlhf.rl.kl import (
    KL_ESTIMATORS, AdaptiveKLController, FixedKLController, kl_penalty, kl_shaped_rewards,
)
from megarlhf.rl.losses import (
    AGGREGATION_MODES, aggregate, entropy_bonus, policy_loss, value_loss,
)

__all__ = [
    "CRITIC_FREE_ESTIMATORS", "critic_free_advantages", "distillation_advantages", "gae",
    "grpo_advantages", "masked_whiten", "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages", "trained_samples", "ema_update", "KL_ESTIMATORS", "AdaptiveKLController",
    "FixedKLController", "kl_penalty", "kl_shaped_rewards", "AGGREGATION_MODES", "aggregate",
    "entropy_bonus", "policy_loss", "value_loss",
]
