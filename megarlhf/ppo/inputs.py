"""Everything the PPO run reads before any rank starts: the prompt datasets (tokenized), the
tokenizer that turns responses back into text, the reward functions (imported, their calling
convention told), and the preflight checks of all of it against the models. The run and its dry
run (`megarlhf ppo --dry-run`) both start here, so they refuse the same mistakes."""

from __future__ import annotations

import dataclasses

from megarlhf.data.prompts import Prompt
from megarlhf.data.tokenizer import Tokenizer
from megarlhf.ppo.config import PPOConfig
from megarlhf.ppo.data import read_run_prompts, run_tokenizer, tokenizer_path
from megarlhf.ppo.preflight import Preflight, preflight
from megarlhf.ppo.rewards import RewardFunction
from megarlhf.rewards.calls import Sample


@dataclasses.dataclass
class RunInputs:
    train: list[Prompt]
    """The prompts rollouts draw from (skip_overlong's drops removed)."""
    val: list[Prompt]
    checked: Preflight
    reward: RewardFunction | None
    tokenizer: Tokenizer | None
    report: dict
    """Per dataset: rows kept and skipped (by reason), prompt format; and what was dropped."""

    def samples(self, prompts: list[Prompt], completions) -> list[Sample]:
        """The reward function's view of `completions` of `prompts`: token ids, and texts when
        the run has a tokenizer."""
        tok, decoded = self.tokenizer, {}
        out = []
        for c in completions:
            p = prompts[c.prompt_index]
            if tok is not None and c.prompt_index not in decoded:
                decoded[c.prompt_index] = tok.decode(p.ids)
            out.append(Sample(prompt=decoded.get(c.prompt_index),
                              response=tok.decode(c.token_ids, skip_special=True)
                              if tok is not None else None,
                              prompt_ids=list(p.ids), response_ids=list(c.token_ids),
                              ground_truth=p.ground_truth, data_source=p.data_source,
                              metadata=p.metadata))
        return out


def read_inputs(config: PPOConfig) -> RunInputs:
    """ValueError naming what is wrong with the run's inputs (see the module doc)."""
    reward = None
    if config.reward_fn or config.reward_fn_by_source:
        reward = RewardFunction(config.reward_fn, config.reward_fn_by_source,
                                allow_non_finite=config.nan_policy == "skip",
                                workers=config.reward_workers, timeout=config.reward_timeout,
                                max_timeout_fraction=config.reward_max_timeout_fraction)
    path = tokenizer_path(config)
    if reward is not None and reward.needs_text and path is None:
        raise ValueError(f"the reward function reads text, but no tokenizer is known to "
                         f"decode responses (the actor checkpoint has no {config.actor}/hf "
                         f"tokenizer); set tokenizer=HF_DIR")
    if config.val_prompts and reward is None:
        raise ValueError("val_prompts: validation scores answers with the reward function; "
                         "set reward_fn (the reward model does not score validation)")
    train, train_report = read_run_prompts(config, "prompts")
    val, val_report = read_run_prompts(config, "val_prompts") if config.val_prompts \
        else ([], None)
    everything = train + val
    checked = preflight(config, [list(p.ids) for p in everything],
                        [p.where for p in everything])
    dropped = set(checked.overlong)
    report = {"prompts": train_report, "val_prompts": val_report,
              "dropped_overlong": len(dropped)}
    kept_train = [p for i, p in enumerate(train) if i not in dropped]
    kept_val = [p for i, p in enumerate(val, start=len(train)) if i not in dropped]
    if not kept_train:
        raise ValueError(f"prompts {config.prompts}: skip_overlong drops every prompt")
    if val and not kept_val:
        raise ValueError(f"val_prompts {config.val_prompts}: skip_overlong drops every "
                         f"validation prompt")
    return RunInputs(train=kept_train, val=kept_val,
                     checked=checked, reward=reward,
                     tokenizer=run_tokenizer(path) if path else None, report=report)
