"""One turn of episodes whose environment's step is a plain function waiting on I/O: the
wall time with the steps one after another (env_workers=1, as plain functions ran before
they had threads of their own) and in env_workers threads, beside the serial sum.

The engine is scripted (every episode answers "12" at once) so the turn's time is the
environment's: 256 episodes whose step sleeps 0.2 s are 51.2 s one after another.

    python -m bench.bench_env_workers [--episodes 256] [--wait 0.2] [--append BENCHMARKS.md]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

from bench.report import append_entry
from megarlhf.data.prompts import Prompt
from megarlhf.data.templates import PromptFormat
from megarlhf.data.tokenizer import load_tokenizer
from megarlhf.envs.base import Environment, Turn
from megarlhf.envs.episodes import EpisodeLimits, EpisodeRunner
from megarlhf.rollout.engine import Completion, SamplingParams
from tests import chat_tokenizer


class Blocking(Environment):
    """A step that blocks for `wait` seconds (a synchronous HTTP call, say), then ends."""

    def __init__(self, wait: float):
        self.wait = wait

    def step(self, response):
        time.sleep(self.wait)
        return Turn(reward=1.0, done=True)


def turn_seconds(tok, fmt, episodes: int, wait: float, workers: int) -> float:
    answer = tok.encode("12") + [tok.eos_id]

    def generate(contexts, params, keys):
        return [Completion(prompt_index=i, token_ids=answer, logprobs=[0.0] * len(answer),
                           finish_reason="stop") for i in range(len(contexts))]

    limits = EpisodeLimits(max_turns=1, max_turn_tokens=8, max_new_tokens=8,
                           max_observation_tokens=8, workers=workers)
    runner = EpisodeRunner(lambda: Blocking(wait), fmt, limits, name="blocking")
    prompt = Prompt(ids=tuple(fmt.prompt([{"role": "user", "content": "Hi"}])),
                    where="bench:1", text="Hi")
    start = time.perf_counter()
    runner.run([prompt], SamplingParams(max_new_tokens=8, n=episodes), generate)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--episodes", type=int, default=256)
    parser.add_argument("--wait", type=float, default=0.2)
    parser.add_argument("--workers", type=int, default=32, help="env_workers of the 'after' run")
    parser.add_argument("--append")
    args = parser.parse_args()
    tok = load_tokenizer(chat_tokenizer.save(tempfile.mkdtemp()))
    fmt = PromptFormat(tok, "chat")
    serial = args.episodes * args.wait
    before = turn_seconds(tok, fmt, args.episodes, args.wait, 1)
    after = turn_seconds(tok, fmt, args.episodes, args.wait, args.workers)
    body = (f"| {args.episodes} episodes, step waits {args.wait} s | seconds | vs serial sum |\n"
            f"|---|---|---|\n"
            f"| serial sum of the steps | {serial:.1f} | 1.00x |\n"
            f"| env_workers=1 (one after another) | {before:.1f} | {serial / before:.2f}x |\n"
            f"| env_workers={args.workers} | {after:.1f} | {serial / after:.2f}x |\n")
    print(body)
    if args.append:
        append_entry(args.append, "A turn of blocking environment steps in env_workers "
                     "threads", "python -m bench.bench_env_workers " + " ".join(sys.argv[1:]),
                     body)


if __name__ == "__main__":
    main()
