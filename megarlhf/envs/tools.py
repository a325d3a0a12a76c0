"""Tool calling: `environment: tools` with `tools: [module:function, ..., python]`.

The model's turn is read by a `tool_parser` for calls; each call runs (a Python function in a
worker process with `tool_timeout`, the built-in `python` in its sandbox) and its result goes
back to the model as a tool message; a turn without a call ends the episode (the model has
answered). A malformed call, an unknown tool, a tool that raises or runs out of time is
answered with an error message the model can read, and counted (env/tool_errors): never a
crash.

- Schemas: each function's JSON schema comes from its signature and docstring (type hints,
  and a Google-style "Args:" section describing every parameter), in the form HF chat
  templates take as `tools=`. A function without them is refused before launch.
- Parsers: `hermes` (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number
  per turn: Qwen2.5, Qwen3, Hermes templates), `llama3_json` (the turn is one JSON object
  `{"name": ..., "parameters": {...}}`, or several separated by ';'), or 'module:function'
  (text -> a list of {"name", "arguments"} dicts; raising means a malformed turn).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re
from typing import Any, Callable

from megarlhf import named
from megarlhf.envs.base import Environment, Turn
from megarlhf.envs.python_tool import PYTHON, PythonSandbox, python_schema
from megarlhf.rewards.pool import CallPool, Outcome

PARSERS = ("hermes", "llama3_json")
"""Built-in tool_parser values (or 'module:function')."""
_HERMES = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


class MalformedCall(ValueError):
    """Text that was meant as a tool call but is not one; the message is shown to the
    model."""


Parsed = list[ToolCall | MalformedCall]


def parse_hermes(text: str) -> Parsed:
    return [_call(body.strip(), "arguments") for body in _HERMES.findall(text)]


def parse_llama3_json(text: str) -> Parsed:
    text = text.strip().removeprefix("<|python_tag|>").strip()
    if not text.startswith("{"):
        return []
    return [_call(part.strip(), "parameters") for part in _split_objects(text)]


def _split_objects(text: str) -> list[str]:
    """';'-separated JSON objects (a ';' inside a string does not split)."""
    decoder, out, at = json.JSONDecoder(), [], 0
    while at < len(text):
        try:
            _, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            out.append(text[at:])
            break
        out.append(text[at:end])
        at = end
        while at < len(text) and text[at] in " \n\t;":
            at += 1
    return out


def _call(body: str, arguments_key: str) -> ToolCall | MalformedCall:
    try:
        value = json.loads(body)
    except json.JSONDecodeError as e:
        return MalformedCall(f"the tool call is not valid JSON ({e.msg} at character "
                             f"{e.pos}): {body[:200]}")
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return MalformedCall(f"a tool call is a JSON object with a \"name\" and "
                             f"\"{arguments_key}\", got: {body[:200]}")
    arguments = value.get(arguments_key, value.get("arguments", {}))
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return MalformedCall(f"the \"{arguments_key}\" of a tool call must be a JSON object, "
                             f"got: {json.dumps(arguments)[:200]}")
    return ToolCall(value["name"], arguments)


_BUILTIN_PARSERS = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}


def load_parser(spec: str) -> Callable[[str], Parsed]:
    if spec in _BUILTIN_PARSERS:
        return _BUILTIN_PARSERS[spec]
    fn = named.load(spec, "tool_parser", _BUILTIN_PARSERS)

    def parse(text: str) -> Parsed:
        try:
            found = fn(text)
            return [c if isinstance(c, ToolCall) else ToolCall(c["name"], c["arguments"])
                    for c in found]
        except Exception as e:  # the user's parser: the turn is malformed, not the run
            return [MalformedCall(f"the tool call could not be read ({type(e).__name__}: "
                                  f"{e})")]

    return parse


def load(spec: str) -> Callable:
    """The tool function `spec` names ('module:function'; the built-in python runs apart)."""
    fn = named.load(spec, "tools:", {})
    if not callable(fn):
        raise ValueError(f"tools: {spec!r} is not callable")
    return fn


def tool_schema(spec: str) -> dict:
    """The JSON schema of the tool `spec` names ('module:function' or 'python'); ValueError
    naming what is missing (a type hint, a parameter's description)."""
    if spec == PYTHON:
        return python_schema()
    from transformers.utils import get_json_schema

    fn = load(spec)
    try:
        return get_json_schema(fn)
    except Exception as e:  # transformers' own parsing errors
        raise ValueError(f"tools: no JSON schema for {spec}: {e} (every parameter needs a "
                         f"type hint and a line in the docstring's Args: section)") from None


def tool_options(schemas: list[dict], parser: str) -> dict:
    """PromptFormat's keyword arguments for tools of these JSON schemas: the schemas (for a
    template that renders `tools=`) and the system message describing them (for one that
    does not)."""
    return {"tools": schemas, "tool_instructions": tool_instructions(schemas, parser)}


def tool_instructions(schemas: list[dict], parser: str) -> str:
    """The system message that describes the tools to a model whose chat template does not
    render `tools=`: their schemas, and how `parser` reads a call."""
    listed = "\n".join(json.dumps(s) for s in schemas)
    how = {"hermes": 'To call one, write <tool_call>{"name": NAME, "arguments": {...}}'
                     '</tool_call>, one per call.',
           "llama3_json": 'To call one, answer with only {"name": NAME, "parameters": '
                          '{...}}.'}.get(parser, "To call one, write the call as you were "
                                                 "told.")
    return f"You can call these functions (JSON schemas):\n{listed}\n{how} Each result " \
           f"comes back in a tool message."


@dataclasses.dataclass
class Toolbox:
    """The run's tools, the parser that finds calls, and where calls run (shared by every
    episode of the run; close() ends the worker processes)."""

    specs: tuple[str, ...]
    parser: str = "hermes"
    timeout: float = 30.0
    workers: int = 2
    memory_mb: int = 1024
    """The python tool's address-space limit."""
    python_workers: int | None = None
    """The most python calls that run at once (None: the machine's cores)."""
    python_packages: tuple[str, ...] = ()
    """Package directories the python tool's code may import."""

    def __post_init__(self):
        self.schemas = [tool_schema(spec) for spec in self.specs]
        names = [s["function"]["name"] for s in self.schemas]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"tools: more than one tool is named {repeated}")
        self.by_name = dict(zip(names, self.specs))
        self.parse = load_parser(self.parser)
        self.sandbox = PythonSandbox(timeout=self.timeout, memory_mb=self.memory_mb,
                                     packages=self.python_packages) \
            if PYTHON in self.specs else None
        self._python_slots: tuple[Any, asyncio.Semaphore] | None = None  # (its loop, it)
        self.pool = CallPool(self.workers, self.timeout)
        self._batches: dict[Any, _Batcher] = {}

    async def run(self, calls: list[ToolCall]) -> list[tuple[str, bool]]:
        """(result text, failed) of each call, in order, run concurrently (and batched with
        the calls of the step's other episodes)."""
        return list(await asyncio.gather(*(self._run_one(c) for c in calls)))

    async def _run_one(self, call: ToolCall) -> tuple[str, bool]:
        spec = self.by_name.get(call.name)
        if spec is None:
            return (f"Error: there is no tool named {call.name!r}; the tools are "
                    f"{sorted(self.by_name)}", True)
        if spec == PYTHON:
            async with self._python_slot():
                return await self.sandbox.run(call.arguments)
        outcome = await self._batcher().call((spec, (), call.arguments))
        if outcome.kind == "timeout":
            return f"Error: {call.name} did not finish within {self.timeout:g} s", True
        if outcome.kind == "error":
            return f"Error: {call.name} {outcome.value}", True
        value = outcome.value
        return (value if isinstance(value, str) else json.dumps(value, default=str)), False

    def _python_slot(self) -> asyncio.Semaphore:
        """The bound on python calls at once, of the running event loop (each rollout runs
        one; a semaphore belongs to one loop)."""
        loop = asyncio.get_running_loop()
        if self._python_slots is None or self._python_slots[0] is not loop:
            self._python_slots = (loop, asyncio.Semaphore(self.python_workers or
                                                          os.cpu_count() or 1))
        return self._python_slots[1]

    def _batcher(self) -> "_Batcher":
        loop = asyncio.get_running_loop()
        if loop not in self._batches:
            self._batches = {loop: _Batcher(self.pool)}  # one event loop per step's episodes
        return self._batches[loop]

    def close(self) -> None:
        self.pool.close()


class _Batcher:
    """Calls made by concurrent episodes in one turn go to the pool as one batch (the pool
    runs a batch at a time, its workers in parallel)."""

    def __init__(self, pool: CallPool):
        self.pool, self.waiting, self.lock = pool, [], asyncio.Lock()
        self._flushes: set = set()

    async def call(self, call: tuple) -> Outcome:
        future = asyncio.get_running_loop().create_future()
        self.waiting.append((call, future))
        if len(self.waiting) == 1:
            task = asyncio.get_running_loop().create_task(self._flush())
            self._flushes.add(task)  # a reference, so the task is not collected
            task.add_done_callback(self._flushes.discard)
        return await future

    async def _flush(self) -> None:
        await asyncio.sleep(0)  # the other episodes of the turn add their calls first
        async with self.lock:
            batch, self.waiting = self.waiting, []
            try:
                outcomes = await asyncio.to_thread(self.pool.run, [c for c, _ in batch])
            except BaseException as e:
                for _, future in batch:
                    future.set_exception(e)
                raise
        for (_, future), outcome in zip(batch, outcomes):
            future.set_result(outcome)


class ToolEnvironment(Environment):
    """The built-in `tools` environment: each turn's tool calls run and answered, the episode
    done at the first turn without one. Its turns report tool_calls and tool_errors."""

    def __init__(self, toolbox: Toolbox):
        self.toolbox = toolbox

    async def step(self, response: str) -> Turn:
        found = self.toolbox.parse(response)
        if not found:
            return Turn(done=True)
        calls = [c for c in found if isinstance(c, ToolCall)]
        results = iter(await self.toolbox.run(calls))
        messages, errors = [], 0
        for c in found:
            if isinstance(c, MalformedCall):
                messages.append({"role": "tool", "content": f"Error: {c}"})
                errors += 1
            else:
                text, failed = next(results)
                messages.append({"role": "tool", "name": c.name, "content": text})
                errors += failed
        return Turn(messages=messages, metrics={"tool_calls": float(len(found)),
                                                "tool_errors": float(errors)})
