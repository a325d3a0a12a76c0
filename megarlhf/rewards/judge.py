"""A generative judge's settings, its prompt template and its verdict parsers: from a sample to
the judge's prompt text, and from the judge's answer to a score. No model here: the controller
(megarlhf/ppo/judge.py) tokenizes the prompts and has the judge's engines answer.

Verdicts:
- yes_no: P(Yes) / (P(Yes) + P(No)) at the judge's first new token, each side summed over its
  spellings with and without a leading space ("Yes", " Yes"; "No", " No") that are one token,
  computed from the engine's log-probabilities of those tokens. A first token that is none of
  them is a parse failure (the controller gives it no score), and the share of the first
  token's probability on them is logged (reward/judge_verdict_mass).
- rating: the last "[[N]]" in the judge's text, N / rating_max clipped to [0, 1].
- regex: the last match of `pattern`; its first group (or the whole match) as a number.
- fn: 'module:function' called with the judge's text, returning a float or None.
A text that does not parse has no score: it is counted (reward/judge_parse_failures) and its
sample masked like any failed score.
"""

from __future__ import annotations

import dataclasses
import math
import re
import string
from typing import Callable, ClassVar

from megarlhf import named

VERDICTS = ("yes_no", "rating", "regex", "fn")
JUDGE_BACKENDS = ("megatron", "vllm")
YES_SPELLINGS = ("Yes", " Yes")
NO_SPELLINGS = ("No", " No")
RATING = re.compile(r"\[\[\s*(-?\d+(?:\.\d+)?)\s*\]\]")
SAMPLE_FIELDS = ("prompt", "response", "ground_truth")
"""Template placeholders every sample fills; the dataset's other columns fill the rest."""


@dataclasses.dataclass(frozen=True)
class JudgeConfig:
    """reward_judge: a language model that reads each sample through a prompt template and
    gives a verdict, scored into the reward (a `rewards` term of kind judge weighs it)."""

    RETIRED: ClassVar[dict[str, str]] = {
        "failure_score": "a verdict that cannot be read gives no score now (the sample is "
                         "masked); PPOConfig.max_failed_reward_fraction bounds their share"}

    model: str
    """The judge: an HF model directory (weights, config.json and tokenizer), or a Megatron
    checkpoint of a language model with its hf/ tokenizer sidecar (backend megatron; its
    weights streamed into the engine under their HF names, LoRA adapters merged)."""
    template: str
    """A text file: the judge's user message, with {prompt} (the prompt's text: a chat
    prompt's last user message), {response}, {ground_truth} and any dataset column in
    braces ({{ and }} for literal braces). Rendered with the judge tokenizer's chat template
    when it has one."""
    backend: str = "megatron"
    """The judge's engine: megatron or vllm, on the rollout ranks beside the actor's engine
    (placement colocated) or on ranks of its own (disaggregated: PPOConfig.judge_nproc), in
    engines of layout.judge.tensor_parallel ranks."""
    verdict: str = "yes_no"
    """yes_no | rating | regex | fn (module doc)."""
    pattern: str | None = None
    """verdict regex: the regular expression whose last match (its first group, if any) is
    the score."""
    function: str | None = None
    """verdict fn: 'module:function' from the judge's text to a score (None: no verdict)."""
    rating_max: float = 10.0
    """verdict rating: the rating that scores 1."""
    max_new_tokens: int = 32
    """Tokens the judge may write (yes_no reads the first only: 1 is enough there)."""
    temperature: float = 0.0
    """The judge's sampling temperature; 0 (greedy) makes its scores repeatable."""

    def problems(self) -> list[str]:
        out = []
        if self.backend not in JUDGE_BACKENDS:
            out.append(f"reward_judge.backend={self.backend!r} is not one of "
                       f"{list(JUDGE_BACKENDS)}")
        if self.verdict not in VERDICTS:
            out.append(f"reward_judge.verdict={self.verdict!r} is not one of {list(VERDICTS)}")
        if (self.verdict == "regex") != (self.pattern is not None):
            out.append("reward_judge.pattern goes with verdict regex, and verdict regex needs "
                       "one")
        elif self.pattern is not None:
            try:
                re.compile(self.pattern)
            except re.error as e:
                out.append(f"reward_judge.pattern {self.pattern!r} is not a regular "
                           f"expression: {e}")
        if (self.verdict == "fn") != (self.function is not None):
            out.append("reward_judge.function goes with verdict fn, and verdict fn needs one")
        if not (self.rating_max > 0 and math.isfinite(self.rating_max)):
            out.append(f"reward_judge.rating_max must be > 0, got {self.rating_max}")
        if self.max_new_tokens < 1:
            out.append(f"reward_judge.max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not (0 <= self.temperature < math.inf):
            out.append(f"reward_judge.temperature must be >= 0, got {self.temperature}")
        return out


def judge_limit(config: JudgeConfig, longest: int, max_positions: int) -> int:
    """The judge engines' length: the judge's positions (a Megatron engine allocates its
    cache per call), or for vLLM's, which allocate a cache for it at start, twice the
    launch-time bound `longest` (room for a judge tokenizer that counts the samples in more
    tokens than the actor's did), within the positions."""
    if config.backend == "megatron":
        return max_positions
    return min(max_positions, 2 * longest)


def template_fields(template: str) -> list[str]:
    """The placeholders of `template`, in order; ValueError for one that is not a plain name
    (an attribute, an index, a format spec) or for unbalanced braces."""
    fields = []
    for _, name, spec, conversion in string.Formatter().parse(template):
        if name is None:
            continue
        if not name.isidentifier() or spec or conversion:
            raise ValueError(f"placeholder {{{name}{'!' + conversion if conversion else ''}"
                             f"{':' + spec if spec else ''}}} is not a plain column name; "
                             f"write {{{{ and }}}} for literal braces")
        fields.append(name)
    return fields


def fill(template: str, values: dict[str, object]) -> str:
    """The template with each placeholder replaced by str() of its value (None: empty)."""
    return template.format_map({k: "" if v is None else str(v) for k, v in values.items()})


class Verdict:
    """The judge's text (and its first token's candidate logprobs) -> a score, or None when
    the text holds no verdict."""

    def __init__(self, config: JudgeConfig):
        self.config = config
        self._fn: Callable[[str], float | None] | None = None
        if config.verdict == "fn":
            self._fn = named.load(config.function, "reward_judge.function", {})
        self._pattern = re.compile(config.pattern) if config.pattern is not None else None

    def score(self, text: str, first_logprobs: tuple[float, ...] | None,
              yes_count: int) -> float | None:
        """`first_logprobs`: the yes spellings' ids' (`yes_count` of them) then the no
        spellings'; yes_no only."""
        kind = self.config.verdict
        if kind == "yes_no":
            return yes_probability(first_logprobs[:yes_count], first_logprobs[yes_count:])
        if kind == "rating":
            found = RATING.findall(text)
            return min(1.0, max(0.0, float(found[-1]) / self.config.rating_max)) \
                if found else None
        if kind == "regex":
            found = list(self._pattern.finditer(text))
            if not found:
                return None
            match = found[-1]
            return _number(match.group(1) if match.re.groups else match.group(0))
        value = self._fn(text)
        if value is None:
            return None
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"reward_judge.function {self.config.function} returned {value} "
                             f"for a judge text {text[:200]!r}; return a finite number or None")
        return value


def yes_probability(yes_logprobs, no_logprobs) -> float:
    """P(yes) / (P(yes) + P(no)), each the sum over its spellings, computed in log space so
    that it holds when both are tiny."""
    return 1.0 / (1.0 + math.exp(_logsumexp(no_logprobs) - _logsumexp(yes_logprobs)))


def _logsumexp(values) -> float:
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values))


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None
