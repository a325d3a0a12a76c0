"""Reward functions that come with megarlhf, batched and text-level like user ones. `math` and
`exact_match` are selected by bare name (`reward_fn=math`); `format_reward` builds a format
check to combine with them in a user module."""

from __future__ import annotations

import re
import string

from megarlhf.rewards.answers import equal, final_answer


def math_reward(responses: list[str], ground_truths: list, **_) -> dict:
    """1.0 when the response's final answer (its last \\boxed{}, '#### N', 'the answer is N',
    or last number) equals the ground truth as a number or as normalized LaTeX, else 0.0.
    Also reports `answered`: whether an answer was found at all (0 hints at a format or
    length problem rather than wrong answers)."""
    answers = [final_answer(r) for r in responses]
    return {"scores": [float(equal(a, t)) for a, t in zip(answers, ground_truths)],
            "answered": [float(a is not None) for a in answers]}


_EDGES = string.whitespace + string.punctuation.replace("%", "")


def _plain(text) -> str:
    return " ".join(str(text).split()).strip(_EDGES).casefold()


def exact_match_reward(responses: list[str], ground_truths: list, **_) -> list[float]:
    """1.0 when the response equals the ground truth (or one of a list of them) after
    case folding, collapsing whitespace and trimming punctuation at both ends, else 0.0."""
    def accepted(truth) -> list:
        return list(truth) if isinstance(truth, (list, tuple)) else [truth]

    return [float(t is not None and any(_plain(r) == _plain(a) for a in accepted(t)))
            for r, t in zip(responses, ground_truths)]


def format_reward(pattern: str, *, score: float = 1.0):
    """A reward function giving `score` to responses in which `pattern` (a regular expression,
    `.` matching newlines) is found, else 0.0; e.g. in a user module:

        has_box = format_reward(r"\\\\boxed\\{.+\\}")
        def reward(responses, ground_truths, **kw):
            right = math_reward(responses, ground_truths)["scores"]
            return [r + 0.1 * f for r, f in zip(right, has_box(responses))]
    """
    compiled = re.compile(pattern, re.DOTALL)

    def check(responses: list[str], **_) -> list[float]:
        return [score if compiled.search(r) else 0.0 for r in responses]

    return check


BUILTINS = {"math": math_reward, "exact_match": exact_match_reward}
"""Bare names `reward_fn` accepts, besides module:function."""
