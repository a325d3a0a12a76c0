"""A step's episodes driven by an agent program (`agent: module:function`) that talks to the
rollout engines through an OpenAI-compatible endpoint (envs/endpoint.py), each episode one
token-exact training row.

For each episode the run awaits `function(base_url=..., api_key=..., model=..., row=row)`;
the API key names the episode. The program calls /v1/chat/completions (or /v1/completions) as
often as it likes, and returns the episode's reward (a float) or None (the run's reward
sources score the final conversation).

Exactness. Clients send text back, never token ids, and may re-serialise what they got. So
every completion the endpoint returns is remembered with its exact context and sampled ids.
A request whose messages are an earlier call's messages, then the assistant message that call
returned (matched by content and tool calls, whatever their serialisation), then new
messages, is that call's exact tokens followed by the new messages as an observation (what
the chat template puts after the model's turn, the messages, the next generation prompt;
PromptFormat.observation, as environments extend episodes). Any other request starts a new
chain from its messages rendered by the template. The episode's row is the last call's chain:
its prompt, the model's tokens as sampled (trained), the rest masked; completions no longer
in it are counted (agent/untrained_completions), not trained.

Batching: the requests of all live episodes are gathered into one engine call: as soon as
every running episode has a request waiting, or BATCH_WAIT_S after the first arrived.

The run's own sampling settings apply to every call (a request's temperature, top_p, seed
are ignored: the trained policy must be the one sampled); `n` > 1 and streaming are refused.
Budgets: `max_turns` calls per episode and `max_new_tokens` tokens after the row's prompt; a
call beyond either is answered at once with an empty message finished by 'length'.
`stop` strings are applied to the sampled text: the tokens after the one that completes a
stop string are neither returned nor trained.

A failed episode (the program raised, timed out after agent_timeout, returned something
that is not a number or None, made no call, or returned None where nothing else scores) is
counted (agent/errors) and masked as a failed score; an episode that made no call gets one
unscored turn from its prompt, so the batch keeps its shape. A failure of the engines is the
run's and stops it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import json
import logging
import math
import queue
import secrets
import threading
import time
from typing import Any, Callable

from megarlhf import named
from megarlhf.data.prompts import Prompt
from megarlhf.data.templates import PromptFormat
from megarlhf.envs.endpoint import Endpoint, error
from megarlhf.envs.episodes import (Episode, EpisodePart, Generate, _last_line, _row,
                                    is_number, turn_call)
from megarlhf.envs.tools import ToolCall, load_parser, tool_options
from megarlhf.rollout.engine import Completion, SamplingParams

_log = logging.getLogger(__name__)

BATCH_WAIT_S = 0.25
"""How long a request waits for the other live episodes' before the engines run without
them (when every running episode has one waiting, the call runs at once)."""
MODEL = "megarlhf-policy"
"""The model name the endpoint lists (a request's `model` is not checked)."""


def load_agent(spec: str) -> Callable:
    """The async function `spec` ('module:function') names; ValueError in one line."""
    fn = named.load(spec, "agent", {})
    if not inspect.iscoroutinefunction(fn):
        raise ValueError(f"agent {spec!r} must be an async function (async def f(*, "
                         f"base_url, api_key, model, row))")
    return fn


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentLimits:
    max_calls: int
    """Calls per episode (max_turns)."""
    max_new_tokens: int
    """Tokens of an episode's row after its prompt."""
    max_tokens: int
    """Prompt + row at most: what the engines and models hold."""
    timeout: float
    """Seconds an episode's program may run."""
    max_requests: int
    """Requests the endpoint serves at once."""
    host: str = "127.0.0.1"


@dataclasses.dataclass
class _Chain:
    """An episode's row as of a call: its prompt, then its tokens."""

    prompt: tuple[int, ...]
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    sampled: list[bool] = dataclasses.field(default_factory=list)
    parts: list[EpisodePart] = dataclasses.field(default_factory=list)
    completions: tuple[int, ...] = ()
    """The episode's engine calls (counted from 0) whose completions the row holds."""
    calls: list[int | None] = dataclasses.field(default_factory=list)
    """Per token: the engine call that sampled it; for a token put between, the call before
    it (None before the first)."""

    @property
    def ids(self) -> list[int]:
        return list(self.prompt) + self.tokens

    def extended(self, ids: list[int], *, sampled: bool, logprobs: list[float] | None = None,
                 part: EpisodePart, call: int | None = None) -> "_Chain":
        """`call`: the engine call that sampled `ids` (sampled only)."""
        before = self.completions[-1] if self.completions else None
        return _Chain(self.prompt, self.tokens + ids,
                      self.logprobs + (logprobs if sampled else [0.0] * len(ids)),
                      self.sampled + [sampled] * len(ids), self.parts + [part],
                      self.completions + ((call,) if sampled else ()),
                      self.calls + [call if sampled else before] * len(ids))


@dataclasses.dataclass
class _Call:
    """A completion the endpoint returned, as the agent may send it back."""

    messages: list[dict] | None
    """Normalised messages of its request (chat), or None (completions)."""
    prompt_text: str | None
    """Its prompt text (completions)."""
    returned: dict | str
    """The normalised assistant message (chat), or the text (completions)."""
    conversation: list[dict]
    """The request's messages and the answer, as sent (what reward functions read)."""
    chain: _Chain
    """The row through its completion."""
    after: int | None
    """The token its turn ended on when the model emitted an end-of-turn, else None."""
    finish: str
    """'stop' (a stop token or string) or 'length'."""


class _Episode:
    def __init__(self, prompt: Prompt, key: int):
        self.prompt, self.key = prompt, key
        self.api_key = f"ep-{key}-{secrets.token_hex(12)}"
        self.calls: list[_Call] = []
        self.requests = 0
        self.generated = 0  # engine calls made for it
        self.lock = asyncio.Lock()  # one call at a time: each extends what came before
        self.error: str | None = None
        self.reward: float | None = None
        self.running = True


@dataclasses.dataclass
class _Waiting:
    episode: _Episode
    context: list[int]
    room: int
    future: asyncio.Future


class AgentRunner:
    def __init__(self, agent: Callable, fmt: PromptFormat, limits: AgentLimits, *,
                 name: str, tool_parser: str, scored_elsewhere: bool):
        """`fmt`: the run's prompt format (its template and tokenizer); `scored_elsewhere`:
        whether the run has a reward source that scores an episode whose program returns
        None."""
        self.agent, self.fmt, self.limits, self.name = agent, fmt, limits, name
        self.tokenizer = fmt.tokenizer
        self.tool_parser, self._parse = tool_parser, load_parser(tool_parser)
        self.scored_elsewhere = scored_elsewhere
        self._formats: dict[str, PromptFormat] = {}

    def run(self, prompts: list[Prompt], params: SamplingParams, generate: Generate
            ) -> tuple[list[Episode], dict[str, float]]:
        """params.n episodes per prompt (a prompt's consecutive), and the step's agent/
        metrics. The programs and the endpoint run on an event loop in a thread of their
        own; the engine calls are made here, in the calling thread, as an environment's turns
        are (what the caller times and pauses between calls is its own thread's)."""
        calls: queue.Queue = queue.Queue()
        outcome: dict = {}

        def serve():
            try:
                outcome["value"] = asyncio.run(self._run(prompts, params, calls))
            except BaseException as e:  # raised below, in the calling thread
                outcome["error"] = e
            finally:
                calls.put(None)

        thread = threading.Thread(target=serve, name="agent-endpoint", daemon=True)
        thread.start()
        while (call := calls.get()) is not None:
            job, settle = call
            try:
                settle(job(generate), None)
            except Exception as e:  # the engines': the loop stops the programs and raises it
                settle(None, e)
        thread.join()
        if "error" in outcome:
            raise outcome["error"]
        return outcome["value"]

    async def _run(self, prompts, params, calls: queue.Queue):
        episodes = [_Episode(prompt, key=i * params.n + j)
                    for i, prompt in enumerate(prompts) for j in range(params.n)]
        self._by_key = {e.api_key: e for e in episodes}
        self._waiting: list[_Waiting] = []
        self._arrived = asyncio.Event()
        self._fault: BaseException | None = None
        self._closing = False
        self._rounds = 0
        self._params, self._calls = params, calls
        endpoint = Endpoint(self._serve, model=MODEL, host=self.limits.host,
                            max_requests=self.limits.max_requests)
        base_url = await endpoint.start()
        start = time.perf_counter()
        self._programs = [asyncio.create_task(self._episode(e, base_url)) for e in episodes]
        batcher = asyncio.create_task(self._batches(episodes))
        try:
            await asyncio.gather(*self._programs, return_exceptions=True)
        finally:
            # The batch in flight ends first: its engine call is never abandoned half-way.
            self._closing = True
            self._arrived.set()
            await asyncio.gather(batcher, return_exceptions=True)
            await endpoint.stop()
        if self._fault is not None:
            raise self._fault
        seconds = time.perf_counter() - start
        lone = [e for e in episodes if not e.calls]
        if lone:  # an unscored turn each, so the batch keeps its shape
            await self._turns(lone, [list(e.prompt.ids) for e in lone],
                              [self.limits.max_new_tokens] * len(lone), fill=True)
        return [self._result(e) for e in episodes], self._metrics(episodes, seconds)

    def _stop(self, fault: BaseException) -> None:
        """A failure of the run's own (the engines', a template's): every program is
        cancelled and run() raises it."""
        if self._fault is None:
            self._fault = fault
        for program in self._programs:
            program.cancel()

    # -- an episode's program ----------------------------------------------------------------

    async def _episode(self, e: _Episode, base_url: str) -> None:
        where = f"agent {self.name} at {e.prompt.where}"
        try:
            async with asyncio.timeout(self.limits.timeout) as limit:
                value = await self.agent(base_url=base_url, api_key=e.api_key, model=MODEL,
                                         row=_row(e.prompt))
        except TimeoutError as ex:
            e.error = (f"{where}: timed out after agent_timeout={self.limits.timeout:g} s"
                       if limit.expired() else f"{where}: {type(ex).__name__}: "
                                                f"{_last_line(ex)}")
        except Exception as ex:  # the user's program
            e.error = f"{where}: {type(ex).__name__}: {_last_line(ex)}"
        else:
            if value is not None and not (is_number(value) and math.isfinite(value)):
                e.error = f"{where} returned {value!r}, not a finite number or None"
            elif value is None and not self.scored_elsewhere:
                e.error = f"{where} returned None, and the run has no reward function or " \
                          f"reward service to score it"
            else:
                e.reward = None if value is None else float(value)
            if e.error is None and not e.calls:
                e.error = f"{where} made no call"
        finally:
            self._end(e)
        if e.error is not None and self._fault is None:
            _log.warning("%s (masked: agent/errors)", e.error)

    def _end(self, e: _Episode) -> None:
        """Its program is over: a request of it still waiting gets no answer, none is
        sampled for it (its key is refused from now on)."""
        e.running = False
        for w in [w for w in self._waiting if w.episode is e]:
            self._waiting.remove(w)
            w.future.cancel()
        self._arrived.set()  # one fewer episode to wait for

    # -- requests ----------------------------------------------------------------------------

    async def _serve(self, route: str, key: str, body: dict) -> tuple[int, dict]:
        e = self._by_key.get(key)
        if e is None or not e.running:
            return error(401, "unknown API key, or its episode has ended",
                         "invalid_api_key")
        if body.get("stream"):
            return error(400, "streaming is not served; call without stream",
                         "invalid_request_error")
        if body.get("n", 1) != 1:
            return error(400, "n > 1 is not served: the run samples its own episodes "
                              "(samples_per_prompt)", "invalid_request_error")
        async with e.lock:
            e.requests += 1
            try:
                return 200, await (self._chat(e, body) if route == "chat"
                                   else self._completion(e, body))
            except _BadRequest as bad:
                return error(400, str(bad), "invalid_request_error")
            except (_Ended, asyncio.CancelledError):
                return error(401, "the episode has ended", "invalid_api_key")
            except Exception as ex:  # ours (a template that cannot render): the run's
                self._stop(ex)
                return error(500, "the run failed", "server_error")

    async def _chat(self, e: _Episode, body: dict) -> dict:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise _BadRequest("messages must be a non-empty list")
        tools = body.get("tools") or None
        fmt = self._format(tools)
        normal = [_normal(m) for m in messages]
        base = self._extends(e, normal)
        if base is not None:
            call, tail = base
            observed = fmt.observation([_rendered(m) for m in messages[tail:]],
                                       after=call.after)
            chain = call.chain.extended(observed, sampled=False, part=EpisodePart(
                ",".join(m["role"] for m in normal[tail:]) or "template",
                self.tokenizer.decode(observed), len(observed), False))
        else:
            chain = self._fresh(e, fmt.prompt([_rendered(m) for m in messages]))
        outcome = await self._sample(e, chain, body)
        if outcome is None:
            return _chat_response(e, "", None, "length", None, len(chain.ids))
        ids, logprobs, text, finish, after, engine_call = outcome
        calls = self._tool_calls(text, len(e.calls)) if tools else None
        returned = {"role": "assistant", "content": None if calls else text}
        if calls:
            returned["tool_calls"] = calls
        done = chain.extended(ids, sampled=True, logprobs=logprobs, call=engine_call,
                              part=EpisodePart("assistant", self.tokenizer.decode(ids),
                                               len(ids), True))
        conversation = [_rendered(m) for m in messages] + [returned]
        self._record(e, _Call(normal, None, _normal(returned), conversation, done, after,
                              finish))
        return _chat_response(e, returned["content"], calls,
                              "tool_calls" if calls and finish == "stop" else finish,
                              self._logprobs(ids, logprobs) if body.get("logprobs") else None,
                              len(chain.ids), len(ids))

    async def _completion(self, e: _Episode, body: dict) -> dict:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, str) or not prompt:
            raise _BadRequest("prompt must be one non-empty text")
        earlier = next((c for c in reversed(e.calls) if c.prompt_text is not None
                        and prompt.startswith(c.prompt_text + c.returned)), None)
        if earlier is not None:
            rest = prompt[len(earlier.prompt_text + earlier.returned):]
            added = self.tokenizer.encode(rest) if rest else []
            chain = earlier.chain.extended(added, sampled=False, part=EpisodePart(
                "text", rest, len(added), False)) if added else earlier.chain
        else:
            chain = self._fresh(e, self.tokenizer.encode(prompt, add_bos=not self.fmt.chat))
        outcome = await self._sample(e, chain, body)
        if outcome is None:
            return _text_response("", "length", None, len(chain.ids), 0)
        ids, logprobs, text, finish, after, engine_call = outcome
        done = chain.extended(ids, sampled=True, logprobs=logprobs, call=engine_call,
                              part=EpisodePart("assistant", self.tokenizer.decode(ids), len(ids),
                                               True))
        self._record(e, _Call(None, prompt, text, [{"role": "user", "content": prompt},
                                                   {"role": "assistant", "content": text}],
                              done, after, finish))
        return _text_response(text, finish,
                              self._logprobs(ids, logprobs) if body.get("logprobs") else None,
                              len(chain.ids), len(ids))

    @staticmethod
    def _record(e: _Episode, call: _Call) -> None:
        """A completion its program receives; none once the program is over (it never saw
        the answer: it is not trained)."""
        if not e.running:
            raise _Ended()
        e.calls.append(call)

    def _extends(self, e: _Episode, normal: list[dict]) -> tuple[_Call, int] | None:
        """The latest call whose request and answer `normal` starts with (and where its new
        messages start), if any."""
        for call in reversed(e.calls):
            if call.messages is None:
                continue
            n = len(call.messages)
            if len(normal) > n and normal[:n] == call.messages and normal[n] == call.returned \
                    and all(m["role"] != "assistant" for m in normal[n + 1:]):
                return call, n + 1
        return None

    def _fresh(self, e: _Episode, ids: list[int]) -> _Chain:
        """A chain from a request's rendered context: the row's prompt when it starts with
        it (the rest, re-rendered text, masked), else the context as the prompt."""
        prompt = list(e.prompt.ids)
        if len(ids) > len(prompt) and ids[:len(prompt)] == prompt:
            rest = ids[len(prompt):]
            return _Chain(tuple(prompt)).extended(rest, sampled=False, part=EpisodePart(
                "context", self.tokenizer.decode(rest), len(rest), False))
        return _Chain(tuple(ids))

    async def _sample(self, e: _Episode, chain: _Chain, body: dict):
        """(ids, logprobs, text, finish_reason, after, the episode's engine call) of the
        engines' answer to `chain`, cut at the first stop string; None when a budget leaves no
        room for a token."""
        stop = body.get("stop") or []
        stop = [stop] if isinstance(stop, str) else stop
        if not all(isinstance(s, str) and s for s in stop):
            raise _BadRequest("stop must be a text or a list of non-empty texts")
        asked = body.get("max_completion_tokens")
        asked = body.get("max_tokens") if asked is None else asked
        if asked is not None and (isinstance(asked, bool) or not isinstance(asked, int)
                                  or asked < 1):
            raise _BadRequest("max_tokens must be a positive integer")
        room = min(self.limits.max_new_tokens - len(chain.tokens),
                   self.limits.max_tokens - len(chain.ids), asked or math.inf)
        if len(e.calls) >= self.limits.max_calls or room < 1:
            return None
        if not e.running:
            raise _Ended()
        loop = asyncio.get_running_loop()
        waiting = _Waiting(e, chain.ids, int(room), loop.create_future())
        self._waiting.append(waiting)
        self._arrived.set()
        c, engine_call = await waiting.future
        ids, logprobs, finish = list(c.token_ids), list(c.logprobs), c.finish_reason
        text = self.tokenizer.decode(ids, skip_special=True)
        after = ids[-1] if finish == "stop" else None
        cut = _stop_cut(self.tokenizer, ids, text, stop)
        if cut is not None:
            kept, text = cut
            ids, logprobs, finish, after = ids[:kept], logprobs[:kept], "stop", None
        return ids, logprobs, text, finish, after, engine_call

    def _tool_calls(self, text: str, call: int) -> list[dict] | None:
        found = [c for c in self._parse(text) if isinstance(c, ToolCall)]
        return [{"id": f"call_{call}_{i}", "type": "function",
                 "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                for i, c in enumerate(found)] or None

    def _logprobs(self, ids: list[int], logprobs: list[float]) -> dict:
        content = []
        for token, lp in zip(ids, logprobs):
            text = self.tokenizer.decode([token])
            content.append({"token": text, "logprob": lp, "bytes": list(text.encode()),
                            "top_logprobs": []})
        return {"content": content}

    def _format(self, tools: list[dict] | None) -> PromptFormat:
        """The run's format, rendering the request's tools (cached by their JSON)."""
        if not tools:
            return self.fmt
        key = json.dumps(tools, sort_keys=True)
        if key not in self._formats:
            if not all(isinstance(t, dict) and isinstance(t.get("function"), dict)
                       for t in tools):
                raise _BadRequest('tools must be a list of {"type": "function", "function": '
                                  '{name, description, parameters}}')
            self._formats[key] = PromptFormat(
                self.tokenizer, "chat" if self.fmt.chat else "plain",
                chat_template=self.fmt.chat_template,
                **tool_options([{"type": "function", "function": t["function"]}
                                for t in tools], self.tool_parser))
        return self._formats[key]

    # -- batching ----------------------------------------------------------------------------

    async def _batches(self, episodes: list[_Episode]) -> None:
        """One engine call for the requests waiting: once every running episode has one,
        or BATCH_WAIT_S after the first. Ends when run() closes, after the call in flight."""
        loop = asyncio.get_running_loop()
        while not self._closing:
            await self._arrived.wait()
            self._arrived.clear()
            if not self._waiting:
                continue
            deadline = loop.time() + BATCH_WAIT_S
            while (len(self._waiting) < sum(e.running for e in episodes)
                   and loop.time() < deadline and not self._closing):
                try:
                    await asyncio.wait_for(self._arrived.wait(), deadline - loop.time())
                except TimeoutError:
                    break
                self._arrived.clear()
            batch, self._waiting = self._waiting, []
            if not batch:
                continue
            try:
                answers = await self._turns([w.episode for w in batch],
                                            [w.context for w in batch], [w.room for w in batch])
            except Exception as ex:  # the engines': the run's failure, not the programs'
                for w in batch:
                    w.future.cancel()
                self._stop(ex)
                return
            for w, answer in zip(batch, answers):
                if not w.future.done():  # its program may have ended meanwhile
                    w.future.set_result(answer)

    async def _turns(self, episodes: list[_Episode], contexts: list[list[int]],
                     rooms: list[int], *, fill: bool = False
                     ) -> list[tuple[Completion, int]]:
        """The engines' completions of `contexts` (in a thread: the endpoint serves on), each
        with its episode's count of engine calls before it (what a fully_async run's weight
        versions are recorded by); `fill`: unscored turns of episodes that made no call, kept
        as their rows."""
        made = [e.generated for e in episodes]
        for e in episodes:
            e.generated += 1
        self._rounds += 1
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def settle(value, error):  # in the calling thread
            loop.call_soon_threadsafe(_settle, future, value, error)

        job = functools.partial(turn_call, contexts=contexts, params=self._params, rooms=rooms,
                                keys=[e.key for e in episodes], turn=self._rounds - 1)
        self._calls.put((job, settle))
        completions = await future
        if fill:
            for e, c, call in zip(episodes, completions, made):
                chain = _Chain(tuple(e.prompt.ids)).extended(
                    list(c.token_ids), sampled=True, logprobs=list(c.logprobs), call=call,
                    part=EpisodePart("assistant", self.tokenizer.decode(c.token_ids),
                                     len(c.token_ids), True))
                e.calls.append(_Call(None, None, "", [], chain, None, c.finish_reason))
        return list(zip(completions, made))

    # -- the step's rows ---------------------------------------------------------------------

    def _result(self, e: _Episode) -> Episode:
        last = e.calls[-1]
        chain = last.chain
        trained = [i for i, s in enumerate(chain.sampled) if s]
        rewards = ((trained[-1], e.reward),) if e.reward is not None and e.error is None \
            else ()
        completion = Completion(prompt_index=e.key, token_ids=chain.tokens,
                                logprobs=chain.logprobs,
                                finish_reason="stop" if last.finish == "stop" else "length",
                                sampled=tuple(chain.sampled))
        final = last.conversation[-1]["content"] or "" if last.conversation else \
            self.tokenizer.decode(chain.tokens, skip_special=True)
        n = chain.parts[-1].tokens
        first = chain.completions[0]
        return Episode(prompt=dataclasses.replace(e.prompt, ids=chain.prompt),
                       completion=completion, parts=tuple(chain.parts), rewards_at=rewards,
                       conversation=tuple(last.conversation), final_response=final,
                       final_ids=tuple(chain.tokens[-n:]), error=e.error,
                       engine_calls=tuple(first if c is None else c for c in chain.calls))

    def _metrics(self, episodes: list[_Episode], seconds: float) -> dict[str, float]:
        count = len(episodes)
        made = [sum(c.messages is not None or c.prompt_text is not None for c in e.calls)
                for e in episodes]
        untrained = sum(m - len(e.calls[-1].chain.completions) for m, e in zip(made, episodes)
                        if m)
        return {"agent/calls_mean": sum(made) / count,
                "agent/errors": float(sum(e.error is not None for e in episodes)),
                "agent/untrained_completions": float(untrained),
                "agent/seconds": seconds}


def _settle(future: asyncio.Future, value, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


class _BadRequest(ValueError):
    """A request the endpoint answers 400."""


class _Ended(Exception):
    """A request of an episode whose program is over (answered 401)."""


def _text_of(content) -> str:
    """A message's content as text: a string, None, or OpenAI content parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    raise _BadRequest(f"message content must be text or content parts, got "
                      f"{type(content).__name__}")


def _normal(message) -> dict:
    """What identifies a message, whatever a client re-serialised: its role, text, tool
    calls (name and parsed arguments) and tool_call_id."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise _BadRequest("each message must be an object with a role")
    out = {"role": message["role"], "content": _text_of(message.get("content")).strip()}
    calls = message.get("tool_calls") or []
    if calls:
        out["tool_calls"] = [(c["function"]["name"], _arguments(c["function"].get("arguments")))
                             for c in calls]
    if message.get("tool_call_id"):
        out["tool_call_id"] = message["tool_call_id"]
    return out


def _arguments(value) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def _rendered(message: dict) -> dict:
    """A message as the chat template renders it: role and text (an assistant's tool calls
    as the template's tool_calls)."""
    out = {"role": message["role"], "content": _text_of(message.get("content"))}
    if message.get("tool_calls"):
        out["tool_calls"] = message["tool_calls"]
    if message.get("tool_call_id"):
        out["tool_call_id"] = message["tool_call_id"]
    return out


def _stop_cut(tokenizer, ids: list[int], text: str, stop: list[str]
              ) -> tuple[int, str] | None:
    """(tokens kept: through the one that completes the first stop string, the text before
    it), or None when no stop string occurs. The shortest prefix whose text holds a stop
    string is found by bisection (a longer prefix holds it too)."""
    if not stop or not any(s in text for s in stop):
        return None
    low, high = 1, len(ids)
    while low < high:
        mid = (low + high) // 2
        if any(s in tokenizer.decode(ids[:mid], skip_special=True) for s in stop):
            high = mid
        else:
            low = mid + 1
    prefix = tokenizer.decode(ids[:low], skip_special=True)
    at = min(prefix.find(s) for s in stop if s in prefix)
    return low, prefix[:at]


def _chat_response(e: _Episode, content: str | None, calls: list[dict] | None, finish: str,
                   logprobs: dict | None, prompt_tokens: int, completion_tokens: int = 0
                   ) -> dict:
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = calls
    return _response(f"chatcmpl-{e.key}-{e.requests}", "chat.completion",
                     {"message": message}, finish, logprobs, prompt_tokens, completion_tokens)


def _text_response(text: str, finish: str, logprobs: dict | None, prompt_tokens: int,
                   completion_tokens: int) -> dict:
    return _response(f"cmpl-{time.time_ns()}", "text_completion", {"text": text}, finish,
                     logprobs, prompt_tokens, completion_tokens)


def _response(ident: str, kind: str, answer: dict, finish: str, logprobs: dict | None,
              prompt_tokens: int, completion_tokens: int) -> dict:
    """An OpenAI response body of one choice (`answer`: its message or text)."""
    return {"id": ident, "object": kind, "created": int(time.time()), "model": MODEL,
            "choices": [{"index": 0, **answer, "finish_reason": finish,
                         "logprobs": logprobs}],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                      "total_tokens": prompt_tokens + completion_tokens}}


