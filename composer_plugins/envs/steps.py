"""The worked steps of an arithmetic solution: the equations ``a op b = c`` it states, and what it computes.

One parser for two uses: :func:`computation_key` names *what a problem computes* (operands and operators,
without the results) for held-out splits (:mod:`.arith`, ``prepare``'s overlap report); :func:`parse_steps` /
:func:`parse_columns` read what a completion states, for the ``step_check`` hint provider (:mod:`.step_check`).

An equation is ``a op b = c`` with ``op`` one of ``+ - * / x × ÷ −``, optionally written GSM8K-style
with a calculator annotation (``3 * 4 = <<3*4=12>>12``); a bare annotation (``<<3*4=12>>``) counts too.
Numbers are integers or decimals (thousands separators allowed).

>>> [s.text for s in parse_steps("3 * 4 = 12\\n7 + 12 = 19\\n#### 19")]
['3 * 4 = 12', '7 + 12 = 19']
>>> computation_key("Tom has 7. 3 * 4 = <<3*4=12>>12, 7 + 12 = <<7+12=19>>19.\\n#### 19")
'3*4;7+12'
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from fractions import Fraction

__all__ = ["Column", "Step", "computation_key", "first_false_step", "format_value", "parse_columns", "parse_steps"]

_N = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"
_OP = r"[-+*/x×÷−]"
#: ``a op b = c`` with an optional calculator annotation between ``=`` and ``c``.
_EQ = re.compile(
    rf"(?<![\w.])(?P<a>{_N})\s*(?P<op>{_OP})\s*(?P<b>{_N})\s*=\s*(?:<<[^<>]*>>\s*)?(?P<c>-?\s*(?:{_N}))(?![\w])"
)
#: A bare calculator annotation ``<<a op b=c>>`` not followed by the plain-text result.
_ANN = re.compile(rf"<<\s*(?P<a>{_N})\s*(?P<op>{_OP})\s*(?P<b>{_N})\s*=\s*(?P<c>-?(?:{_N}))\s*>>")
_CHAINED = frozenset("+-*/×÷−")
#: One column of a column-by-column addition: ``digit + digit + carry in = sum``.
_COLUMN = re.compile(r"(?<![\w.+])(\d)\s*\+\s*(\d)\s*\+\s*(\d)\s*=\s*(\d+)(?![\w])")
_CANON = {"+": "+", "-": "-", "−": "-", "*": "*", "x": "*", "×": "*", "/": "/", "÷": "/"}
_SHOW = {"+": "+", "-": "-", "*": "×", "/": "÷"}
_APPLY = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv}


def _num(text: str) -> Fraction:
    return Fraction(text.replace(",", "").replace(" ", ""))


def format_value(v: Fraction) -> str:
    """``12`` for an integer value, else the shortest decimal (``2.5``) or the fraction (``1/3``)."""
    if v.denominator == 1:
        return str(v.numerator)
    as_float = float(v)
    if Fraction(repr(as_float)) == v:
        return repr(as_float)
    return f"{v.numerator}/{v.denominator}"


@dataclass(frozen=True)
class Step:
    """One stated equation: ``a op b = stated`` at character ``start`` of the text (``op`` canonical)."""

    a: Fraction
    op: str
    b: Fraction
    stated: Fraction
    start: int
    text: str

    @property
    def value(self) -> Fraction | None:
        """The true value of ``a op b`` (``None`` for a division by zero)."""
        return None if self.op == "/" and self.b == 0 else _APPLY[self.op](self.a, self.b)

    @property
    def holds(self) -> bool:
        """Whether the stated result is the true one."""
        return self.value is not None and self.value == self.stated

    def shown(self, value: Fraction | None = None) -> str:
        """``7 × 2 = 14`` (the true value, or ``value``)."""
        v = self.value if value is None else value
        res = "undefined" if v is None else format_value(v)
        return f"{format_value(self.a)} {_SHOW[self.op]} {format_value(self.b)} = {res}"

    @property
    def key(self) -> str:
        """``3*4``: the operands and operator, without the result."""
        return f"{format_value(self.a)}{self.op}{format_value(self.b)}"


def parse_steps(text: str) -> list[Step]:
    """Every equation ``text`` states, in order (a plain equation and its own annotation count once)."""
    found: list[Step] = []
    covered: list[tuple[int, int]] = []
    for m in _EQ.finditer(text):
        if text[: m.start()].rstrip()[-1:] in _CHAINED:
            continue  # the tail of a longer sum (``8+5+1=14``: a column line, :func:`parse_columns`), not a step
        found.append(_step(m, text))
        covered.append(m.span())
    for m in _ANN.finditer(text):
        if any(s < m.end() and m.start() < e for s, e in covered):
            continue
        found.append(_step(m, text))
    found.sort(key=lambda s: s.start)
    return found


def _step(m: re.Match[str], text: str) -> Step:
    return Step(_num(m["a"]), _CANON[m["op"]], _num(m["b"]), _num(m["c"]), m.start(), " ".join(m.group(0).split()))


@dataclass(frozen=True)
class Column:
    """One stated column line ``a+b+carry=stated`` (single digits, the carry in from the column before)."""

    a: int
    b: int
    carry: int
    stated: int

    @property
    def fact(self) -> str:
        """``7+6+1=14`` with the true sum: the single-step fact the line applies."""
        return f"{self.a}+{self.b}+{self.carry}={self.a + self.b + self.carry}"


def parse_columns(text: str) -> list[Column]:
    """Every column line ``text`` states, in order (level ``columns`` of :mod:`.arith`)."""
    return [Column(*(int(g) for g in m.groups())) for m in _COLUMN.finditer(text)]


def computation_key(solution: str) -> str:
    """What ``solution`` computes: its equations' ``a op b`` joined by ``;`` (``""`` when it states none)."""
    return ";".join(s.key for s in parse_steps(solution))


def first_false_step(text: str) -> tuple[int, Step] | None:
    """``(1-based index, step)`` of the first stated equation that does not hold, or ``None``."""
    for i, s in enumerate(parse_steps(text), 1):
        if not s.holds:
            return i, s
    return None
