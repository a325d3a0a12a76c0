"""Final answers out of model text, normalized so that equal answers compare equal.

A response's answer is, in this order: the last `\\boxed{...}` (or `\\fbox{...}`, braces
balanced), the text after the last GSM8K-style `####`, what follows the last "answer is" /
"answer:", and else the last number in the text. Two answers are equal when both read as
numbers that agree to a relative 1e-6 (integers, decimals, thousands separators, fractions
a/b and \\frac{a}{b}, a trailing % or degree sign, a leading "x =" dropped), or else when their
normalized LaTeX-stripped texts are equal.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*:?", re.IGNORECASE)
_THOUSANDS = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")
_FRAC = re.compile(r"^(-?)\\[dt]?frac\{(-?\d+)\}\{(-?\d+)\}$")
_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")
_DROP = ("\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\ ", "$", "^\\circ", "^{\\circ}",
         "°", "\\%", "%")


def boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} in `text` (nested braces kept), or None."""
    found = None
    for m in _BOX.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            found = text[m.end():i - 1]
    return found


def final_answer(text: str) -> str | None:
    """The answer `text` ends on (see the module doc), or None when it has none."""
    text = text.replace("\u2212", "-")  # the Unicode minus models like to write
    inside = boxed(text)
    if inside is not None:
        return inside.strip()
    if "####" in text:
        after = text.rsplit("####", 1)[1].strip()
        return after.splitlines()[0].strip() if after else None
    said = list(_ANSWER_IS.finditer(text))
    stated = text[said[-1].end():].strip() if said else ""
    stated = stated.splitlines()[0].strip().rstrip(".") if stated else ""
    if stated:
        # "The answer is 42 apples." -> 42; "The answer is Paris." -> Paris
        numbers = _NUMBER.findall(stated)
        return numbers[0] if numbers and _as_number(stated) is None else stated
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def normalize(answer: str) -> str:
    """LaTeX and formatting stripped, for comparing answers that are not numbers."""
    s = answer.strip().replace("\u2212", "-")
    s = _TEXT.sub(r"\1", s)
    for token in _DROP:
        s = s.replace(token, "")
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    s = re.sub(r"^[a-zA-Z]\s*=\s*", "", s)  # "x = 5" -> "5"
    s = re.sub(r"\s+", "", s).rstrip(".").lower()
    return s


def _as_number(answer: str) -> Fraction | float | None:
    s = normalize(answer)
    if _THOUSANDS.match(s):
        s = s.replace(",", "")
    frac = _FRAC.match(s)
    if frac:
        sign, num, den = frac.groups()
        s = f"{sign}{num}/{den}"
    try:
        value = Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
    return value


def equal(answer: str | None, truth) -> bool:
    """Whether `answer` equals the ground truth `truth` (text, a number, or a list of
    accepted answers; a GSM8K solution or a \\boxed{} truth is reduced to its answer)."""
    if answer is None or truth is None:
        return False
    if isinstance(truth, (list, tuple)):
        return any(equal(answer, t) for t in truth)
    if isinstance(truth, bool):
        truth = str(truth)
    if isinstance(truth, (int, float)):
        truth = repr(truth) if isinstance(truth, float) else str(truth)
    truth = str(truth)
    if "####" in truth or boxed(truth) is not None:
        truth = final_answer(truth) or truth
    a, b = _as_number(answer), _as_number(truth)
    if a is not None and b is not None:
        return math.isclose(float(a), float(b), rel_tol=1e-6, abs_tol=1e-9)
    return normalize(answer) == normalize(truth)
