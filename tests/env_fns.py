"""Environments, tools and tool parsers for the multi-turn tests, importable by module:name (the
controller constructs environments; tool workers import tools)."""

from __future__ import annotations

import asyncio
import time

from megarlhf.envs import Environment, Turn


class Scripted(Environment):
    """Answers turn k with `replies[k]` (a list of messages) and reward k + 1; done after
    `turns` turns. Records the responses it saw."""

    def __init__(self, replies: list[list[dict]] | None = None, turns: int = 3,
                 reset_messages: list[dict] | None = None):
        self.replies = replies or [[{"role": "user", "content": "Go on."}]]
        self.turns, self.reset_messages = turns, reset_messages
        self.seen: list[str] = []
        self.row = None

    def reset(self, row):
        self.row = row
        return self.reset_messages

    def step(self, response):
        self.seen.append(response)
        k = len(self.seen) - 1
        return Turn(messages=self.replies[min(k, len(self.replies) - 1)], reward=k + 1.0,
                    done=len(self.seen) >= self.turns, metrics={"turn": float(k + 1)})


class AsyncSleeper(Environment):
    """An async step that waits `seconds` (a tool on the network) before answering."""

    def __init__(self, seconds: float = 0.3, turns: int = 2):
        self.seconds, self.turns, self.count = seconds, turns, 0

    async def step(self, response):
        await asyncio.sleep(self.seconds)
        self.count += 1
        return Turn(messages=[{"role": "user", "content": "More."}], reward=0.5,
                    done=self.count >= self.turns)


class SyncSleeper(Environment):
    """AsyncSleeper's step as a plain function (blocking I/O, e.g. a requests call)."""

    def __init__(self, seconds: float = 0.3, turns: int = 2):
        self.seconds, self.turns, self.count = seconds, turns, 0

    def step(self, response):
        time.sleep(self.seconds)
        self.count += 1
        return Turn(messages=[{"role": "user", "content": "More."}], reward=0.5,
                    done=self.count >= self.turns)


class Failing(Environment):
    """Raises in step at turn `at` (1-based), or in reset with at=0."""

    def __init__(self, at: int = 2):
        self.at, self.count = at, 0

    def reset(self, row):
        if self.at == 0:
            raise KeyError("no such task\nthe task id 'x' is unknown")

    def step(self, response):
        self.count += 1
        if self.count >= self.at:
            raise RuntimeError("the simulator crashed")
        return Turn(messages=[{"role": "user", "content": "Again."}], reward=1.0)


class NotATurn(Environment):
    def step(self, response):
        return {"reward": 1.0}


class LowIds(Environment):
    """For toy models: each turn's reward is the share of its text's characters among the
    first letters of the alphabet (learnable by a random model: it shifts its tokens), and
    the observation a fixed user message; `turns` model turns. On the rows whose ground truth
    is in `crash_on`, step raises at the second turn (an environment's infrastructure
    failing)."""

    def __init__(self, turns: int = 3, crash_on: tuple = ()):
        self.turns, self.count, self.crash_on, self.crashes = turns, 0, crash_on, False

    def reset(self, row):
        self.crashes = row["ground_truth"] in self.crash_on

    def step(self, response):
        self.count += 1
        if self.crashes and self.count == 2:
            raise ConnectionError("the simulator went away")
        share = sum(c in "abcdefgh" for c in response) / max(1, len(response))
        return Turn(messages=[{"role": "user", "content": "Next."}], reward=share,
                    done=self.count >= self.turns, metrics={"share": share})


class NoStep:
    def reset(self, row):
        return None

    def close(self):
        pass


class WrongStep(Environment):
    def step(self):
        return Turn()


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def sleep_for(seconds: float) -> str:
    """Wait, then say so.

    Args:
        seconds: How long to wait.
    """
    time.sleep(seconds)
    return "done"


def window(seconds: float) -> str:
    """Wait, and say when the wait began and ended (wall-clock seconds).

    Args:
        seconds: How long to wait.
    """
    start = time.time()
    time.sleep(seconds)
    return f"{start} {time.time()}"


def explode(reason: str) -> str:
    """Always fails.

    Args:
        reason: Why.
    """
    raise ArithmeticError(f"cannot: {reason}")


def untyped(x):
    """No type hint.

    Args:
        x: Something.
    """
    return x


def bracket_parser(text: str) -> list[dict]:
    """A custom tool_parser: calls written as [[name a b]] with integer arguments a, b."""
    import re

    return [{"name": name, "arguments": {"a": int(a), "b": int(b)}}
            for name, a, b in re.findall(r"\[\[(\w+) (-?\d+) (-?\d+)\]\]", text)]


def every_turn_adds(text: str) -> list[dict]:
    """A tool_parser for toy models (which write no JSON): every turn calls add with the
    turn's length in characters and 1."""
    return [{"name": "add", "arguments": {"a": len(text), "b": 1}}]
