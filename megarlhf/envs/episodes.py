"""A step's multi-turn episodes: the model answers, the environment replies, the model goes on,
all episodes of the step together, and each episode becomes one training row.

Per turn, one generation call serves every live episode (the engines batch it); then each
episode's environment steps, all of them concurrently where `step` is async. An episode is
the prompt followed by its tokens:

    prompt | model turn 1 | observation 1 | model turn 2 | ... | model turn k

- Model turns are kept exactly as the engine sampled them, with its logprobs: never decoded
  and re-tokenized. The next turn's context is exactly these tokens, so the trainer's row is
  byte for byte what the engine continued from.
- An observation is the environment's messages as tokens (`PromptFormat.observation`): what
  the chat template puts after the model's end-of-turn (a newline; the end-of-turn itself
  when the turn was cut at its length and never emitted it), the messages, and the next
  turn's generation prompt. All of it is masked (`Completion.sampled` False): only the
  model's tokens are trained on, including the end-of-turn token it emitted.
- Budgets: a turn takes at most max_turn_tokens and what is left of max_new_tokens (the whole
  episode after the prompt); an episode whose next observation would leave no room for a
  model token ends, so its last turn is always the model's. An observation longer than
  max_observation_tokens is cut (its messages' text shortened) and counted.
- Rewards: each turn's reward sits at its last model token (`Episode.rewards_at`), for PPO's
  per-token rewards; the episode's reward is their sum.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import inspect
import logging
import numbers
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from megarlhf.data.prompts import Prompt
from megarlhf.data.templates import PromptFormat
from megarlhf.envs.base import ROLES, Turn
from megarlhf.rollout.engine import Completion, SamplingParams

_log = logging.getLogger(__name__)

ENV_ERROR_POLICIES = ("stop", "drop")
TURN_SEED = 2**40
"""Seed offset between the turns of a step (rounds of a step differ by 2**32)."""
SUMMED = {"tool_calls": "env/tool_calls_mean", "tool_errors": "env/tool_errors"}
"""Turn metrics logged as totals rather than means over turns: tool calls per episode, and
the step's failed tool calls."""


class EpisodeError(ValueError):
    """An environment failed (raised, or answered with something that is not a Turn); the
    message names it, the prompt row and the turn."""


@dataclasses.dataclass(frozen=True)
class EpisodePart:
    """One entry of an episode's transcript (samples.jsonl)."""

    role: str
    """'assistant' for a model turn; an observation's message roles, joined by ','."""
    text: str
    tokens: int
    trained: bool


@dataclasses.dataclass(frozen=True)
class Episode:
    prompt: Prompt
    """The row, with `ids` the context of the first turn (its prompt and any messages the
    environment's reset added)."""
    completion: Completion
    """Every token after the prompt; `sampled` marks the model's."""
    parts: tuple[EpisodePart, ...]
    rewards_at: tuple[tuple[int, float], ...]
    """(index in completion.token_ids of a model turn's last token, the turn's reward)."""
    conversation: tuple[dict, ...]
    """The episode as messages: the prompt's, the reset's, then model turns (decoded) and
    observations (as shown, after any cut)."""
    final_response: str
    final_ids: tuple[int, ...]
    """The last model turn, as text and token ids (what a reward function scores)."""
    error: str | None = None
    """The environment's failure, when on_env_error=drop ended the episode: it has no score
    (the controller masks it)."""
    engine_calls: tuple[int, ...] | None = None
    """Per token of `completion`: the episode's engine call (counted from 0) that sampled it,
    or for a token put between, the call before it. None: each turn one call, in order (an
    environment's). A fully_async run dates each token by its call's weight version."""

    @property
    def reward(self) -> float:
        return sum(r for _, r in self.rewards_at)


@dataclasses.dataclass(frozen=True, kw_only=True)
class EpisodeLimits:
    max_turns: int
    max_turn_tokens: int
    max_new_tokens: int
    max_observation_tokens: int
    on_env_error: str = "stop"
    max_prompt_tokens: int | None = None
    """The longest prompt an episode may start from (the engines' length less
    max_new_tokens): reset messages must keep within it."""
    workers: int = 32
    """Threads for the reset() and step() of environments written as plain functions."""


Generate = Callable[[list[list[int]], SamplingParams, list[int]], list[Completion]]
"""(contexts, params, keys) -> one completion per context (Placement.rollout)."""


class EpisodeRunner:
    def __init__(self, make_env: Callable[[], Any], fmt: PromptFormat, limits: EpisodeLimits,
                 *, name: str):
        """`make_env`: a fresh environment per episode; `name`: the environment as the recipe
        names it (for messages)."""
        if limits.on_env_error not in ENV_ERROR_POLICIES:
            raise ValueError(f"on_env_error must be one of {ENV_ERROR_POLICIES}, got "
                             f"{limits.on_env_error!r}")
        self.make_env, self.fmt, self.limits, self.name = make_env, fmt, limits, name
        self.tokenizer = fmt.tokenizer
        self._checking = False
        self._threads: ThreadPoolExecutor | None = None  # a run's, for plain functions

    def check(self, prompt: Prompt) -> None:
        """EpisodeError (a ValueError) when the environment cannot start an episode on
        `prompt`: it is constructed, reset and closed, and what reset adds rendered, before
        any rank starts."""
        strict = EpisodeRunner(self.make_env, self.fmt, self.limits, name=self.name)
        strict._checking = True  # any failure stops, whatever on_env_error says

        async def probe():
            s = _State(prompt, key=0)
            try:
                await strict._reset(s)
            finally:
                await strict._close(s)

        asyncio.run(probe())

    def run(self, prompts: list[Prompt], params: SamplingParams, generate: Generate
            ) -> tuple[list[Episode], dict[str, float]]:
        """params.n episodes per prompt (a prompt's consecutive), and the step's env/
        metrics."""
        return asyncio.run(self._run(prompts, params, generate))

    async def _run(self, prompts, params, generate):
        states = [_State(prompt, key=i * params.n + j)
                  for i, prompt in enumerate(prompts) for j in range(params.n)]
        clock = {"env": 0.0}
        self._threads = ThreadPoolExecutor(self.limits.workers, thread_name_prefix="env")
        try:
            await self._timed(clock, [self._reset(s) for s in states])
            live = states
            for turn in range(self.limits.max_turns):
                self._generate(live, params, turn, generate)
                answers = await self._timed(clock, [self._step(s, turn) for s in live])
                live = [s for s, answer in zip(live, answers)
                        if self._answered(s, answer, turn)]
                if not live:
                    break
        finally:
            try:
                await self._timed(clock, [self._close(s) for s in states])
            finally:
                self._threads.shutdown(wait=True)
                self._threads = None
        return [s.episode(self.tokenizer) for s in states], self._metrics(states, clock["env"])

    async def _call(self, method, *args):
        """An environment's method: a coroutine function awaited on the event loop, a plain
        one in the run's threads (one episode's calls come one after another, so an
        environment object is used by one thread at a time)."""
        if inspect.iscoroutinefunction(method) or self._threads is None:
            return await _maybe_await(method(*args))
        loop = asyncio.get_running_loop()
        return await _maybe_await(await loop.run_in_executor(self._threads, method, *args))

    # -- a turn ------------------------------------------------------------------------------

    def _generate(self, live: list["_State"], params: SamplingParams, turn: int,
                  generate: Generate) -> None:
        room = [min(self.limits.max_turn_tokens, self.limits.max_new_tokens - len(s.tokens))
                for s in live]
        completions = turn_call(generate, [s.context for s in live], params, room,
                                [s.key for s in live], turn)
        for s, c in zip(live, completions):
            s.add_turn(c, self.tokenizer)

    def _answered(self, s: "_State", answer: Turn | None, turn: int) -> bool:
        """Take the environment's answer; whether the episode goes on."""
        if answer is None:  # failed (on_env_error=drop): ends unscored
            return False
        if not is_number(answer.reward):
            raise EpisodeError(f"environment {self.name} at {s.prompt.where}, turn {turn + 1}: "
                               f"Turn.reward must be a number, got {answer.reward!r}")
        s.rewards_at.append((len(s.tokens) - 1, float(answer.reward)))
        s.turn_metrics.append(dict(answer.metrics))
        if answer.done:
            return False
        if len(s.tokens) >= self.limits.max_new_tokens or turn + 1 == self.limits.max_turns:
            s.truncated = True
            return False
        ids, messages = self._observation(s, answer.messages, turn)
        if len(s.tokens) + len(ids) + 1 > self.limits.max_new_tokens:
            s.truncated = True  # no room left for a model token after it
            return False
        s.add_observation(ids, messages, self.tokenizer)
        return True

    def _observation(self, s: "_State", messages: list[dict], turn: int
                     ) -> tuple[list[int], list[dict]]:
        """The observation's tokens, cut to max_observation_tokens, and its messages as
        shown."""
        self._check_messages(messages, s, turn)
        after = s.tokens[-1] if s.finish_reason == "stop" else None
        limit = self.limits.max_observation_tokens
        messages = [dict(m) for m in messages]
        ids = self.fmt.observation(messages, after=after)
        for attempt in range(16):  # each pass shortens the longest message; a few suffice
            if len(ids) <= limit:
                s.cuts += attempt > 0
                return ids, messages
            longest = max(range(len(messages)),
                          key=lambda i: len(messages[i]["content"]), default=None)
            content = self.tokenizer.encode(messages[longest]["content"]) \
                if longest is not None else []
            if not content:
                break
            keep = max(0, len(content) - (len(ids) - limit))
            messages[longest]["content"] = self.tokenizer.decode(content[:keep])
            ids = self.fmt.observation(messages, after=after)
        raise EpisodeError(f"max_observation_tokens={limit} cannot hold an observation of "
                           f"environment {self.name} even with its text cut ({len(ids)} tokens "
                           f"of template around {[m['role'] for m in messages]} messages); "
                           f"raise it")

    def _check_messages(self, messages, s: "_State", turn: int) -> None:
        ok = isinstance(messages, (list, tuple)) and all(
            isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)
            for m in messages)
        if not ok:
            raise EpisodeError(f"environment {self.name} at {s.prompt.where}, turn "
                               f"{turn + 1}: Turn.messages must be a list of {{'role': one of "
                               f"{list(ROLES)}, 'content': text}} dicts, got "
                               f"{str(messages)[:120]}")

    # -- calls into the environment ----------------------------------------------------------

    async def _reset(self, s: "_State") -> None:
        try:
            s.env = self.make_env()
            added = await self._call(s.env.reset, _row(s.prompt))
        except Exception as e:  # the user's code
            self._failed(s, e, "reset", 0)
            return
        if added:
            self._check_messages(added, s, -1)
            if s.prompt.text is None:
                raise EpisodeError(
                    f"environment {self.name} added messages at reset, but the row at "
                    f"{s.prompt.where} is pre-tokenized (prompt_ids): give the prompts as "
                    f"text so the conversation can be rendered")
            conversation = _prompt_messages(s.prompt.text) + [dict(m) for m in added]
            s.prompt = dataclasses.replace(s.prompt, ids=tuple(self.fmt.prompt(conversation)))
            s.conversation = conversation
            most = self.limits.max_prompt_tokens
            if most is not None and len(s.prompt.ids) > most:
                raise EpisodeError(
                    f"environment {self.name} added messages at reset that make the prompt "
                    f"at {s.prompt.where} {len(s.prompt.ids)} tokens; next to max_new_tokens "
                    f"the models and engines hold prompts of {most}: raise "
                    f"rollout_max_model_len (vLLM) or shorten the messages")

    async def _step(self, s: "_State", turn: int) -> Turn | None:
        if s.error is not None:  # its reset failed: one turn from the row's prompt, unscored
            return None
        try:
            answer = await self._call(s.env.step, s.texts[-1])
        except Exception as e:  # the user's code
            return self._failed(s, e, "step", turn + 1)
        if not isinstance(answer, Turn):
            raise EpisodeError(f"environment {self.name} at {s.prompt.where}, turn {turn + 1}: "
                               f"step() returned {type(answer).__name__}, not a "
                               f"megarlhf.envs.Turn")
        return answer

    async def _close(self, s: "_State") -> None:
        """A failure here loses nothing of the episode: it is logged, not raised."""
        if s.env is None:
            return
        try:
            await self._call(s.env.close)
        except Exception as e:  # the user's code
            _log.warning("environment %s failed in close() at %s: %s: %s", self.name,
                         s.prompt.where, type(e).__name__, _last_line(e))

    def _failed(self, s: "_State", e: Exception, where: str, turn: int) -> None:
        message = (f"environment {self.name} failed in {where}() at {s.prompt.where}, turn "
                   f"{turn}: {type(e).__name__}: {_last_line(e)}")
        if self._checking:
            raise EpisodeError(message + " (checked on the first prompt row before "
                                         "launch)") from e
        if self.limits.on_env_error == "stop":
            raise EpisodeError(message + " (on_env_error=drop masks such episodes and goes "
                                         "on)") from e
        s.error = message
        s.rewards_at.clear()

    async def _timed(self, clock: dict, calls: list) -> list:
        """The calls' results, once every one has ended (a failure of one is raised only
        then, so no environment is closed while a thread still runs its step)."""
        start = time.perf_counter()
        try:
            results = await asyncio.gather(*calls, return_exceptions=True)
        finally:
            clock["env"] += time.perf_counter() - start
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            raise failure
        return results

    # -- metrics -----------------------------------------------------------------------------

    def _metrics(self, states: list["_State"], env_seconds: float) -> dict[str, float]:
        turns = [len(s.texts) for s in states]
        out = {"env/turns_mean": sum(turns) / len(states), "env/turns_max": float(max(turns)),
               "env/observation_tokens_mean": sum(s.observation_tokens for s in states)
               / len(states),
               "env/truncated_fraction": sum(s.truncated for s in states) / len(states),
               "env/errors": float(sum(s.error is not None for s in states)),
               "env/observations_cut": float(sum(s.cuts for s in states)),
               "env/seconds": env_seconds}
        reported: dict[str, list[float]] = {}
        for s in states:
            for metrics in s.turn_metrics:
                for key, value in metrics.items():
                    reported.setdefault(key, []).append(float(value))
        for key, values in sorted(reported.items()):
            if key in SUMMED:
                per_episode = key == "tool_calls"
                out[SUMMED[key]] = sum(values) / (len(states) if per_episode else 1)
            else:
                out[f"env/{key}"] = sum(values) / len(values)
        return out


class _State:
    """One episode while it runs."""

    def __init__(self, prompt: Prompt, key: int):
        self.prompt, self.key = prompt, key
        self.env = None
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.sampled: list[bool] = []
        self.texts: list[str] = []  # the model's turns
        self.parts: list[EpisodePart] = []
        self.conversation: list[dict] = _prompt_messages(prompt.text) if prompt.text else []
        self.rewards_at: list[tuple[int, float]] = []
        self.turn_metrics: list[dict] = []
        self.finish_reason = "length"
        self.routing = None
        self.truncated = False
        self.cuts = 0
        self.observation_tokens = 0
        self.error: str | None = None
        self.last_ids: list[int] = []

    @property
    def context(self) -> list[int]:
        return list(self.prompt.ids) + self.tokens

    def add_turn(self, c: Completion, tokenizer) -> None:
        self.tokens += c.token_ids
        self.logprobs += c.logprobs
        self.sampled += [True] * len(c.token_ids)
        self.finish_reason, self.routing, self.last_ids = c.finish_reason, c.routing, c.token_ids
        text = tokenizer.decode(c.token_ids, skip_special=True)
        self.texts.append(text)
        # The transcript keeps the end-of-turn token the model emitted: it was trained on.
        self.parts.append(EpisodePart("assistant", tokenizer.decode(c.token_ids),
                                      len(c.token_ids), True))
        self.conversation.append({"role": "assistant", "content": text})

    def add_observation(self, ids: list[int], messages: list[dict], tokenizer) -> None:
        self.tokens += ids
        self.logprobs += [0.0] * len(ids)
        self.sampled += [False] * len(ids)
        self.observation_tokens += len(ids)
        self.parts.append(EpisodePart(",".join(m["role"] for m in messages),
                                      tokenizer.decode(ids), len(ids), False))
        self.conversation += messages

    def episode(self, tokenizer) -> Episode:
        completion = Completion(prompt_index=self.key, token_ids=self.tokens,
                                logprobs=self.logprobs, finish_reason=self.finish_reason,
                                routing=self.routing, sampled=tuple(self.sampled))
        return Episode(prompt=self.prompt, completion=completion, parts=tuple(self.parts),
                       rewards_at=tuple(self.rewards_at), conversation=tuple(self.conversation),
                       final_response=self.texts[-1], final_ids=tuple(self.last_ids),
                       error=self.error)


def turn_call(generate: Generate, contexts: list[list[int]], params: SamplingParams,
              rooms: list[int], keys: list[int], turn: int) -> list[Completion]:
    """One engine call for turn `turn` of live episodes: one completion per context, each of
    at most its room, seeded apart from the step's other turns (turns past 15, an agent's
    many rounds, by a hash of the seed and turn: clear of the offsets of rounds and steps)."""
    seed = params.seed
    if seed is not None:
        seed = seed + turn * TURN_SEED if turn < 16 else int.from_bytes(
            hashlib.blake2b(f"{seed}:{turn}".encode(), digest_size=7).digest(), "big")
    completions = generate(contexts, dataclasses.replace(
        params, n=1, max_new_tokens=max(rooms), max_new_tokens_each=tuple(rooms), seed=seed),
        keys)
    if len(completions) != len(contexts):
        raise RuntimeError(f"the rollout engines returned {len(completions)} completions for "
                           f"{len(contexts)} episodes")
    return completions


def is_number(value) -> bool:
    """A reward's type: a real number, not a bool."""
    return not isinstance(value, bool) and isinstance(value, numbers.Real)


def _row(prompt: Prompt) -> dict:
    """The dataset row as an environment's reset sees it."""
    row = {**prompt.metadata, "ground_truth": prompt.ground_truth,
           "data_source": prompt.data_source}
    if prompt.text is None:
        row["prompt_ids"] = list(prompt.ids)
    else:
        row["prompt"] = prompt.text if isinstance(prompt.text, str) else \
            [{"role": role, "content": content} for role, content in prompt.text]
    return row


def _prompt_messages(text) -> list[dict]:
    if isinstance(text, str):
        return [{"role": "user", "content": text}]
    return [{"role": role, "content": content} for role, content in text]


async def _maybe_await(value):
    return await value if inspect.isawaitable(value) else value


def _last_line(e: BaseException) -> str:
    text = e.args[0] if len(e.args) == 1 and isinstance(e.args[0], str) else str(e)
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "(no message)"
