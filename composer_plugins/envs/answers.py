r"""Final-answer extraction for GSM8K-style math: ``#### 42``, ``\boxed{42}``, "the answer is 42", last number.

Numbers are compared exactly as fractions after normalisation (docs/envs.md, "Answer extraction").

>>> extract_answer("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72")
'72'
>>> extract_answer("So she has $1,234.50 left. The answer is \\boxed{\\$1{,}234.5}.")
'1234.5'
>>> answers_match("the answer is 0.50", "1/2")
True
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from fractions import Fraction

__all__ = ["answers_match", "extract_answer", "extract_answer_value", "extract_boxed", "format_number", "parse_number"]

_NUM = re.compile(
    r"""
    (?<![\w.\d])
    (?P<sign>[-−–](?=\s?[\d.]))?\s?
    (?P<int>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+)
    (?:\s?/\s?(?P<den>\d+(?:\.\d+)?)(?![\d.]))?
    """,
    re.VERBOSE,
)
_ANSWER_IS = re.compile(r"(?:final\s+answer|answer)\s*(?:is|:|=|was|would\s+be|will\s+be)?\s*[:=]?\s*", re.IGNORECASE)
_WORDS = {
    "zero": 0,
    "one": 1,
    "two": 2,
    "three": 3,
    "four": 4,
    "five": 5,
    "six": 6,
    "seven": 7,
    "eight": 8,
    "nine": 9,
    "ten": 10,
    "eleven": 11,
    "twelve": 12,
    "thirteen": 13,
    "fourteen": 14,
    "fifteen": 15,
    "sixteen": 16,
    "seventeen": 17,
    "eighteen": 18,
    "nineteen": 19,
    "twenty": 20,
    "thirty": 30,
    "forty": 40,
    "fifty": 50,
    "sixty": 60,
    "seventy": 70,
    "eighty": 80,
    "ninety": 90,
    "hundred": 100,
}
_CALC = re.compile(r"<<[^<>]*>>")


def _clean(text: str) -> str:
    """Remove things that break number parsing: calculator annotations, currency, LaTeX spacing."""
    text = _CALC.sub("", text)
    text = text.replace("{,}", ",").replace("\\!", "").replace("\\,", "").replace("\\ ", " ")
    text = re.sub(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}", r"(\1)/(\2)", text)
    text = re.sub(r"\\[dt]?frac(\d)(\d)", r"\1/\2", text)
    text = re.sub(r"\((-?[\d.,]+)\)/\((-?[\d.,]+)\)", r"\1/\2", text)
    text = re.sub(r"\\(?:text|mathrm|textbf|mathbf|operatorname)\s*\{([^{}]*)\}", r" \1 ", text)
    text = text.replace("\\$", "").replace("$", "").replace("\\%", "").replace("%", "")
    text = text.replace("\\left", "").replace("\\right", "").replace("\\cdot", "*").replace("\\times", "*")
    return text.replace("£", "").replace("€", "").replace("¥", "")


def parse_number(text: str) -> Fraction | None:
    """The first number in ``text`` as an exact :class:`~fractions.Fraction` (None if there is none)."""
    m = _NUM.search(_clean(text))
    return _to_fraction(m) if m else None


def _to_fraction(m: re.Match[str]) -> Fraction | None:
    try:
        value = Fraction(m.group("int").replace(",", ""))
        if m.group("den"):
            den = Fraction(m.group("den"))
            if den == 0:
                return None
            value /= den
    except (ValueError, ZeroDivisionError):
        return None
    return -value if m.group("sign") else value


def _numbers(text: str) -> list[Fraction]:
    return [v for v in (_to_fraction(m) for m in _NUM.finditer(_clean(text))) if v is not None]


def _word_number(text: str) -> Fraction | None:
    found = None
    for w in re.findall(r"[a-zA-Z]+(?:-[a-zA-Z]+)?", text.lower()):
        parts = w.split("-")
        if all(p in _WORDS for p in parts) and parts:
            found = Fraction(sum(_WORDS[p] for p in parts))
    return found


def extract_boxed(text: str) -> str | None:
    r"""Content of the last ``\boxed{...}`` (or ``\fbox{...}``), braces balanced; None if absent."""
    idx = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if idx < 0:
        return None
    i = text.find("{", idx)
    if i < 0:
        rest = text[idx + len("\\boxed") :].strip()
        return rest.split()[0] if rest else None
    depth, start = 0, i + 1
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[start:j]
    return text[start:]


def _answer_spans(text: str) -> Iterator[str]:
    """The places a final answer is stated, in the order they are tried (lazily: the first number wins)."""
    # 1. GSM8K's "#### <answer>": the first one (a model that keeps generating often writes more).
    pos = text.find("####")
    if pos >= 0:
        yield text[pos + 4 :].strip().split("\n", 1)[0]
    # 2. \boxed{...}: the last one.
    boxed = extract_boxed(text)
    if boxed is not None:
        yield boxed
    # 3. "the answer is X" / "Answer: X": the last such phrase followed by a number.
    for m in reversed(list(_ANSWER_IS.finditer(text))):
        yield text[m.end() : m.end() + 80].split("\n", 1)[0]


def extract_answer_value(text: str | None) -> Fraction | None:
    """The final numeric answer of ``text`` (see :func:`extract_answer`), as a Fraction."""
    if not text:
        return None
    for span in _answer_spans(text):
        v = parse_number(span)
        if v is not None:
            return v
    # 4. The last number anywhere; then a number word.
    nums = _numbers(text)
    return nums[-1] if nums else _word_number(text)


def format_number(value: Fraction) -> str:
    """Canonical text of a number: ``42``, ``-3.5``, ``1/3`` (non-terminating decimals stay fractions)."""
    if value.denominator == 1:
        return str(value.numerator)
    d = value.denominator
    while d % 2 == 0:
        d //= 2
    while d % 5 == 0:
        d //= 5
    if d != 1:
        return f"{value.numerator}/{value.denominator}"
    digits = 0
    scaled = value
    while scaled.denominator != 1:
        scaled *= 10
        digits += 1
    sign = "-" if value < 0 else ""
    s = str(abs(scaled.numerator)).rjust(digits + 1, "0")
    return f"{sign}{s[:-digits]}.{s[-digits:]}"


def extract_answer(text: str | None) -> str | None:
    """The final numeric answer of ``text`` in canonical form (:func:`format_number`), or None.

    Order: the first ``#### x``; the last ``\\boxed{x}``; the last "answer is x"; the last number;
    a number word if the text has no digits.
    """
    v = extract_answer_value(text)
    return None if v is None else format_number(v)


def answers_match(prediction: str | None, gold: str | int | float | None, rel_tol: float = 0.0) -> bool:
    """Whether the answer extracted from ``prediction`` equals ``gold`` (a number or a solution)."""
    p = extract_answer_value(prediction)
    if isinstance(gold, int | float) and not isinstance(gold, bool):
        g: Fraction | None = Fraction(gold)
    else:
        g = extract_answer_value(str(gold)) if gold is not None else None
    if p is None or g is None:
        return False
    return p == g or (rel_tol > 0 and abs(p - g) <= rel_tol * max(abs(g), Fraction(1)))
