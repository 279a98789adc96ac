"""The ``oracle`` teacher: a deterministic, free, rule-based teacher for verifiable tasks.

What it answers and when it abstains: docs/replay.md, "Teachers". The arithmetic of the last user message is
evaluated on the AST with fractions (never ``eval``).
"""

from __future__ import annotations

import ast
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from fractions import Fraction
from typing import Any

from composer_plugins.core.registry import import_object
from composer_plugins.teachers.base import (
    Teacher,
    TeacherCallError,
    TeacherError,
    TeacherResponse,
)

Solver = Callable[[Sequence[Mapping[str, Any]], Mapping[str, Any]], Any]

_WORDS = [
    (r"\bmultiplied\s+by\b", "*"),
    (r"\bdivided\s+by\b", "/"),
    (r"\btimes\b", "*"),
    (r"\bplus\b", "+"),
    (r"\bminus\b", "-"),
    (r"[×x✕](?=\s*[\d(])", "*"),
    (r"÷", "/"),
]
_EXPR = re.compile(r"[\d\s.+\-*/%()]+")
_OPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}


def _eval(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Expression):
        return _eval(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float) and not isinstance(node.value, bool):
        return Fraction(str(node.value))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        v = _eval(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _eval(node.left), _eval(node.right)
        if isinstance(node.op, ast.Pow) and (right.denominator != 1 or abs(right) > 64):
            raise ValueError("exponent too large or fractional")
        return Fraction(_OPS[type(node.op)](left, right))
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def format_number(value: Fraction | float | int) -> str:
    """``42`` for integral values, otherwise a short decimal (``2.5``)."""
    f = Fraction(value)
    return str(f.numerator) if f.denominator == 1 else f"{float(f):.6g}"


def solve_arithmetic(text: str) -> str | None:
    """Evaluate the (longest) arithmetic expression in ``text``; ``None`` when there is none."""
    s = text
    for pat, rep in _WORDS:
        s = re.sub(pat, rep, s, flags=re.IGNORECASE)
    s = s.replace(",", "")  # thousands separators
    candidates = []
    for m in _EXPR.finditer(s):
        expr = m.group(0).strip().rstrip(".").strip()
        if re.search(r"\d", expr) and re.search(r"\d\s*[+\-*/%]\s*[\d(]|\)\s*[+\-*/%]", expr):
            candidates.append(expr)
    for expr in sorted(candidates, key=len, reverse=True):
        try:
            return format_number(_eval(ast.parse(expr, mode="eval")))
        except (SyntaxError, ValueError, ZeroDivisionError, OverflowError):
            continue
    return None


def _last_user_text(messages: Sequence[Mapping[str, Any]]) -> str:
    for m in reversed(messages):
        if m.get("role") == "user":
            c = m.get("content")
            if isinstance(c, str):
                return c
            if isinstance(c, list):
                return "\n".join(str(p.get("text", "")) for p in c if isinstance(p, Mapping))
    return ""


def _resolve_solver(solver: Solver | str | None) -> Solver | None:
    if solver is None or callable(solver):
        return solver
    if isinstance(solver, str) and ":" in solver:
        try:
            obj = import_object(solver)
        except (ImportError, AttributeError) as e:
            raise TeacherError(f"oracle teacher: cannot import solver {solver!r}: {e}") from e
        if not callable(obj):
            raise TeacherError(f"oracle teacher: solver {solver!r} is not callable")
        return obj
    raise TeacherError(f"oracle teacher: solver must be a callable or a 'module:attr' string, got {solver!r}")


class OracleTeacher(Teacher):
    """Deterministic rule-based teacher for verifiable tasks (GSM8K-format arithmetic by default).

    ``solver(messages, metadata) -> answer | None`` (a callable or ``"module:attr"``) replaces the rules;
    ``answer_key`` names the metadata field of a known answer.
    """

    kind = "oracle"
    cacheable = False

    def __init__(
        self,
        id: str | None = "oracle",
        solver: Solver | str | None = None,
        answer_key: str | None = "answer",
        template: str = "#### {answer}",
        max_concurrency: int = 64,
    ) -> None:
        super().__init__(id=id or "oracle", model="oracle", max_tokens=1, max_concurrency=max_concurrency)
        if "{answer}" not in template:
            raise TeacherError("oracle teacher: template must contain {answer}")
        self.solver = _resolve_solver(solver)
        self.answer_key = answer_key
        self.template = template

    def cache_params(self) -> dict[str, Any]:
        return {"template": self.template, "solver": getattr(self.solver, "__qualname__", None)}

    def solve(self, messages: Sequence[Mapping[str, Any]], metadata: Mapping[str, Any] | None = None) -> str | None:
        """The answer for a state, or ``None`` when the oracle cannot tell."""
        meta = metadata or {}
        if self.solver is not None:
            ans = self.solver(messages, meta)
            return None if ans is None else str(ans)
        if self.answer_key and meta.get(self.answer_key) is not None:
            return str(meta[self.answer_key]).strip()
        return solve_arithmetic(_last_user_text(messages))

    async def complete(
        self, messages: Sequence[Mapping[str, Any]], *, metadata: Mapping[str, Any] | None = None
    ) -> TeacherResponse:
        answer = self.solve(messages, metadata)
        if answer is None:
            raise TeacherCallError(
                f"teacher {self.id!r}: no verifiable answer for this state (abstains)",
                retryable=False,
                kind="abstain",
            )
        return self.response(self.template.format(answer=answer))
