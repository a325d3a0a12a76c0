"""Everything the PPO run reads before any rank starts: the prompt datasets (tokenized), the
tokenizer that turns responses back into text, the reward functions (imported, their calling
convention told), and the preflight checks of all of it against the models. The run and its dry
run (`megarlhf ppo --dry-run`) both start here, so they refuse the same mistakes."""

from __future__ import annotations

import dataclasses
import logging

from megarlhf.data.prompts import Prompt
from megarlhf.data.tokenizer import Tokenizer
from megarlhf.envs.agents import AgentLimits, AgentRunner, load_agent
from megarlhf.envs.episodes import Episode, EpisodeLimits, EpisodeRunner
from megarlhf.envs.loading import environment_factory
from megarlhf.envs.tools import Toolbox
from megarlhf.ppo.config import PPOConfig
from megarlhf.ppo.data import read_run_prompts, run_format, run_tokenizer, tokenizer_path
from megarlhf.ppo.judge import Judge
from megarlhf.ppo.preflight import Preflight, preflight
from megarlhf.ppo.remote_reward import RemoteReward, check_reachable, read_headers
from megarlhf.ppo.rewards import RewardFunction
from megarlhf.rewards.calls import Sample
from megarlhf.rollout.sizing import EngineSize

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Scorer:
    """A reward computed in the launching process: a function or the reward service."""

    name: str | None
    """Its `rewards` term's name (logged as reward/<name>); None: reward_fn or reward_url
    without `rewards`."""
    weight: float
    scorer: RewardFunction | RemoteReward


@dataclasses.dataclass
class RunInputs:
    train: list[Prompt]
    """The prompts rollouts draw from (skip_overlong's drops removed)."""
    val: list[Prompt]
    checked: Preflight
    scorers: list[Scorer]
    tokenizer: Tokenizer | None
    report: dict
    """Per dataset: rows kept and skipped (by reason), prompt format; and what was dropped."""
    episodes: EpisodeRunner | AgentRunner | None = None
    """With an environment or an agent: runs the multi-turn episodes."""
    toolbox: Toolbox | None = None
    judge: Judge | None = None
    """With reward_judge: builds the judge's prompts and reads its verdicts."""
    judge_size: EngineSize | None = None
    """With a vLLM judge (reward_judge.backend=vllm): its engines' size."""

    def samples(self, prompts: list[Prompt], completions,
                episodes: list[Episode] | None = None) -> list[Sample]:
        """The reward function's view of `completions` of `prompts`: token ids, and texts when
        the run has a tokenizer. Of an episode: its last model turn as the response, the
        whole episode as the `conversation` column."""
        tok, decoded = self.tokenizer, {}
        out = []
        for row, c in enumerate(completions):
            p = prompts[c.prompt_index]
            if tok is not None and c.prompt_index not in decoded:
                decoded[c.prompt_index] = tok.decode(p.ids)
            if episodes is None:
                response = tok.decode(c.token_ids, skip_special=True) \
                    if tok is not None else None
                ids, metadata = c.token_ids, p.metadata
            else:
                e = episodes[row]
                response, ids = e.final_response, e.final_ids
                metadata = {**p.metadata, "conversation": list(e.conversation)}
            out.append(Sample(prompt=decoded.get(c.prompt_index), response=response,
                              prompt_ids=list(p.ids), response_ids=list(ids),
                              ground_truth=p.ground_truth, data_source=p.data_source,
                              metadata=metadata))
        return out

    def close(self) -> None:
        """End the reward and tool worker processes."""
        for pool in [s.scorer for s in self.scorers] + [self.toolbox]:
            if pool is not None:
                pool.close()


def _check_taught(config: PPOConfig, train: list[Prompt]) -> None:
    """ValueError naming the data sources of training prompts no teacher scores (with
    teacher_by_source and no `teacher`): their rows would train on a term nobody computed."""
    if not config.teachers:
        return
    untaught = sorted({"(none)" if p.data_source is None else p.data_source
                       for p in train if config.teacher_of(p.data_source) is None})
    if untaught:
        raise ValueError(f"teacher_by_source maps no teacher for the prompts of data source(s) "
                         f"{', '.join(untaught)} in {config.prompts}, and teacher is unset: "
                         f"map them (a prompt without a data_source, '(none)', needs one "
                         f"given), or set teacher for every other source")


def read_inputs(config: PPOConfig) -> RunInputs:
    """ValueError naming what is wrong with the run's inputs (see the module doc)."""
    scorers = _scorers(config)
    path = tokenizer_path(config)
    for s in scorers:
        if s.scorer.needs_text and path is None:
            what = (f"reward_url_format={config.reward_url_format} sends texts"
                    if isinstance(s.scorer, RemoteReward) else "the reward function reads text")
            raise ValueError(f"{what}, but no tokenizer is known to decode responses (the "
                             f"actor checkpoint has no {config.actor}/hf tokenizer); set "
                             f"tokenizer=HF_DIR")
    if config.episodic and path is None:
        raise ValueError(f"{'agent' if config.agent else 'environment'}: episodes are "
                         f"rendered as text, but no tokenizer is "
                         f"known (the actor checkpoint has no {config.actor}/hf tokenizer); "
                         f"set tokenizer=HF_DIR")
    if config.val_prompts and not scorers and not config.episodic:
        raise ValueError("val_prompts: validation scores answers with the reward function; "
                         "set reward_fn or reward_url (the reward model and the judge do not "
                         "score validation)")
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
    _check_taught(config, kept_train)
    if val and not kept_val:
        raise ValueError(f"val_prompts {config.val_prompts}: skip_overlong drops every "
                         f"validation prompt")
    tokenizer = run_tokenizer(path) if path else None
    toolbox = runner = None
    if config.environment is not None:
        toolbox, runner = _environment(config, tokenizer, kept_train[0],
                                       checked.max_prompt_tokens)
    elif config.agent is not None:
        runner = _agent(config, tokenizer, checked.max_prompt_tokens, scorers,
                        kept_train + kept_val)
    judge = judge_size = None
    if config.reward_judge is not None:
        if path is None:
            raise ValueError(f"reward_judge reads the responses as text, but no tokenizer is "
                             f"known to decode them (the actor checkpoint has no "
                             f"{config.actor}/hf tokenizer); set tokenizer=HF_DIR")
        names = set.intersection(*(set(p.metadata) for p in kept_train))
        # Each column with its longest value, for the judge's length check.
        columns = {name: max((p.metadata[name] for p in kept_train), key=lambda v: len(str(v)))
                   for name in names}
        columns["ground_truth"] = max((p.ground_truth for p in kept_train),
                                      key=lambda v: len(str(v)) if v is not None else 0)
        if config.episodic:
            columns["conversation"] = None  # the episode's turns (RunInputs.samples)
        judge = Judge(config.reward_judge, columns, seed=config.seed,
                      tensor_parallel=config.judge_tp,
                      decode_prompt=lambda ids: tokenizer.decode(ids, skip_special=True),
                      longest_sample=max(len(p.ids) for p in kept_train)
                      + config.max_new_tokens)
        if config.reward_judge.backend == "vllm":
            judge_size = config.judge_engine_size(judge.model, judge.longest, judge.limit)
    return RunInputs(train=kept_train, val=kept_val,
                     checked=checked, scorers=scorers, tokenizer=tokenizer, report=report,
                     episodes=runner, toolbox=toolbox, judge=judge, judge_size=judge_size)


def _scorers(config: PPOConfig) -> list[Scorer]:
    """The rewards scored in this process (the reward model's and the judge's run on the
    ranks): each `rewards` term but those, or else reward_fn (with reward_fn_by_source) and
    reward_url, unnamed, weight 1."""
    def function(spec: str | None, by_source: dict | None = None) -> RewardFunction:
        return RewardFunction(spec, by_source, allow_non_finite=config.nan_policy == "skip",
                              workers=config.reward_workers, timeout=config.reward_timeout)

    if not config.rewards:
        out = []
        if config.reward_fn or config.reward_fn_by_source:
            out.append(Scorer(None, 1.0, function(config.reward_fn,
                                                  config.reward_fn_by_source)))
        if config.reward_url is not None:
            out.append(Scorer(None, 1.0, _remote_reward(config)))
        return out
    return [Scorer(t.name, t.weight, _remote_reward(config) if t.kind == "url"
                   else function(t.function or t.kind))
            for t in config.rewards if t.kind not in ("reward_model", "judge")]


def _remote_reward(config: PPOConfig) -> RemoteReward:
    """The reward service's client, its headers read and its server reachable."""
    headers = read_headers(config.reward_url_headers_env)
    if config.reward_url_check:
        check_reachable(config.reward_url)
    return RemoteReward(config.reward_url, fmt=config.reward_url_format,
                        batch_size=config.reward_url_batch_size,
                        concurrency=config.reward_url_concurrency,
                        timeout=config.reward_timeout, retries=config.reward_url_retries,
                        headers=headers, allow_non_finite=config.nan_policy == "skip")


def _agent(config: PPOConfig, tokenizer: Tokenizer, max_prompt_tokens: int,
           scorers: list[Scorer], prompts: list[Prompt]) -> AgentRunner:
    """The agent program's episode runner, checked: the program loads (an async function),
    every row gives it a prompt as text, and the chat template renders what programs send
    back after a model turn as tokens of their own."""
    fn = load_agent(config.agent)
    ids_only = next((p for p in prompts if p.text is None), None)
    if ids_only is not None:
        raise ValueError(f"agent {config.agent} reads the prompt row as text, but the row at "
                         f"{ids_only.where} is pre-tokenized (prompt_ids): give the prompts "
                         f"as text or messages")
    fmt = run_format(config, tokenizer)
    _check_renders(fmt, ("user",))
    try:  # a program that never calls tools needs none
        _check_renders(fmt, ("tool",))
    except ValueError as e:
        log.warning("%s: a program that sends tool results will stop the run", e)
    # Every episode of a step (or of validation) may wait on a request at once.
    most = config.agent_max_requests or 2 * max(config.rows_per_step, len(prompts))
    limits = AgentLimits(max_calls=config.max_turns, max_new_tokens=config.max_new_tokens,
                         max_tokens=max_prompt_tokens + config.max_new_tokens,
                         timeout=config.agent_timeout, max_requests=most)
    # A program's None is scored by what scores validation too: the reward function or
    # service (the reward model and the judge score training samples only).
    return AgentRunner(fn, fmt, limits, name=config.agent, tool_parser=config.tool_parser,
                       scored_elsewhere=bool(scorers))


def _check_renders(fmt, roles: tuple[str, ...]) -> None:
    """ValueError unless the chat template renders a message of each of `roles` after a
    model turn as tokens of their own (an environment's observations, what an agent sends
    back)."""
    for role in roles:
        try:
            fmt.observation([{"role": role, "content": ""}], after=None)
        except Exception as e:  # the template's own error, or ours
            raise ValueError(f"the chat template cannot render a {role} message after a "
                             f"model turn: {e}") from None


def _environment(config: PPOConfig, tokenizer: Tokenizer, first: Prompt,
                 max_prompt_tokens: int | None) -> tuple[Toolbox | None, EpisodeRunner]:
    """The episode runner, checked: the environment constructs and resets on the first
    prompt row, and the chat template renders what it answers as tokens of their own."""
    from megarlhf.envs.python_tool import PYTHON, check_sandbox

    toolbox = None
    if config.environment == "tools":
        toolbox = Toolbox(tuple(config.tools), parser=config.tool_parser,
                          timeout=config.tool_timeout, workers=config.tool_workers,
                          memory_mb=config.tool_memory_mb,
                          python_workers=config.tool_python_workers,
                          python_packages=tuple(config.tool_python_packages))
        if toolbox.sandbox is not None:  # the escape probe, before any rank starts
            check_sandbox(toolbox.sandbox)
    make_env = environment_factory(config.environment, dict(config.env_args),
                                   toolbox=toolbox)
    fmt = run_format(config, tokenizer)
    limits = EpisodeLimits(max_turns=config.max_turns, max_turn_tokens=config.turn_tokens,
                           max_new_tokens=config.max_new_tokens,
                           max_observation_tokens=config.observation_tokens,
                           on_env_error=config.on_env_error,
                           max_prompt_tokens=max_prompt_tokens, workers=config.env_workers)
    runner = EpisodeRunner(make_env, fmt, limits, name=config.environment)
    runner.check(first)
    roles = ("user", "tool") if toolbox is not None else ("user",)
    _check_renders(fmt, roles)
    for role in roles:
        frame = len(fmt.observation([{"role": role, "content": ""}], after=None))
        if frame >= config.observation_tokens:
            raise ValueError(f"max_observation_tokens={config.observation_tokens} cannot hold "
                             f"an empty {role} message with its template tokens ({frame}); "
                             f"raise it")
    return toolbox, runner
