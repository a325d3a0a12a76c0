"""The built-in `arithmetic_retry` environment: the model answers a question with a known
answer (the row's ground_truth, e.g. the arithmetic rows of megarlhf/data/synthetic.py) and,
after a wrong answer, is told so and tries again, up to `max_tries` times. A right answer at
try k earns `decay ** (k - 1)` (1 at the first try, less after); a wrong one 0. Its turns
report `correct`, and the first turn `first_try_correct` (logged as env/first_try_correct:
the accuracy a single-answer run would have)."""

from __future__ import annotations

from megarlhf.envs.base import Environment, Turn
from megarlhf.rewards.answers import equal, final_answer


class RetryArithmetic(Environment):
    def __init__(self, max_tries: int = 3, decay: float = 0.5,
                 retry_message: str = "That is not right. Try again: answer with only the "
                                      "number."):
        if max_tries < 1 or not 0 <= decay <= 1:
            raise ValueError(f"arithmetic_retry needs max_tries >= 1 and decay in [0, 1], got "
                             f"{max_tries}, {decay}")
        self.max_tries, self.decay, self.retry_message = max_tries, decay, retry_message
        self.truth, self.tries = None, 0

    def reset(self, row: dict) -> None:
        if row.get("ground_truth") is None:
            raise ValueError("the row has no ground_truth to check answers against")
        self.truth, self.tries = row["ground_truth"], 0

    def step(self, response: str) -> Turn:
        self.tries += 1
        right = equal(final_answer(response), self.truth)
        metrics = {"correct": float(right)}
        if self.tries == 1:
            metrics["first_try_correct"] = float(right)
        if right:
            return Turn(reward=self.decay ** (self.tries - 1), done=True, metrics=metrics)
        return Turn(messages=[{"role": "user", "content": self.retry_message}],
                    done=self.tries >= self.max_tries, metrics=metrics)
