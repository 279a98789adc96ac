"""``step_check``: a hint that locates the mistake in a worked arithmetic solution (registry kind ``hints``).

The verifier of a GSM8K-format env only says the final number is wrong; this provider recomputes the steps the
completion states (:mod:`.steps`). Every hint, with examples, and the arguments (``fallback``: a name, config
dict or object; ``template``; ``hidden_template``, used when the true value is the final answer, so
``{equation}`` has none): docs/envs.md ("Hints", ``columns``).
"""

from __future__ import annotations

from collections.abc import Mapping
from fractions import Fraction
from typing import Any

from composer_plugins.envs.answers import extract_answer_value
from composer_plugins.envs.base import prompt_text
from composer_plugins.envs.hints import HintProvider, HintRequest, build_hint_provider
from composer_plugins.envs.steps import Column, Step, format_value, parse_columns, parse_steps

__all__ = ["StepCheckHintProvider", "false_step_attempt", "locate_mistake"]

FALSE_STEP = "Step {index}: {equation}, not {stated}."
FALSE_STEP_HIDDEN = "Step {index}: {expression} is not {stated}."
_VERB = {"+": "add", "-": "subtract", "*": "multiply", "/": "divide"}


def _worked(text: str) -> str:
    """The part of a completion before its final ``####`` line (what follows is not a step)."""
    return text.split("####", 1)[0]


def _expression(step: Step) -> str:
    return step.shown().rsplit(" = ", 1)[0]


def _gold(task: Mapping[str, Any] | None) -> tuple[list[Step], Fraction | None]:
    if not task:
        return [], None
    solution = task.get("solution") or task.get("target")
    steps = parse_steps(_worked(str(solution))) if isinstance(solution, str) else []
    answer = task.get("answer")
    gold = extract_answer_value(str(answer)) if answer is not None else None
    if gold is None and isinstance(solution, str) and "####" in solution:
        gold = extract_answer_value(solution[solution.find("####") :])
    return steps, gold


def _used_wrongly(i: int, got: Step, want: Step) -> str | None:
    """Which quantity step ``i`` used wrongly, comparing it with the solution's step ``want``."""
    if got.op != want.op:
        return f"Step {i} should {_VERB[want.op]}, not {_VERB[got.op]}."
    pairs = [(got.a, want.a), (got.b, want.b)]
    if got.op in "+*" and {got.a, got.b} == {want.a, want.b}:
        return None
    if got.op in "+*" and (got.a == want.b or got.b == want.a):
        pairs = [(got.a, want.b), (got.b, want.a)]  # the same operands written the other way round
    for g, w in pairs:
        if g != w:
            return f"Step {i} uses {format_value(g)} where it needs {format_value(w)}."
    return None


_PLACES = ("ones", "tens", "hundreds", "thousands", "ten-thousands")


def _column_mistake(got: list[Column], want: list[Column], completion: str) -> str | None:
    """The first wrong column of a column-by-column sum, and what it is computed from (never its result)."""
    for i, (c, w) in enumerate(zip(got, want, strict=False), 1):
        place = _PLACES[min(i, len(_PLACES)) - 1]
        name = f"Column {i} ({place})"
        if (c.a, c.b) != (w.a, w.b):
            return f"{name} adds the {place} digits {w.a} and {w.b}, not {c.a} and {c.b}."
        if c.carry != w.carry:
            if i == 1:
                return f"{name} has no carry in: 0, not {c.carry}."
            return f"{name}: its carry in is the tens digit of column {i - 1}'s sum, not {c.carry}."
        if c.stated != c.a + c.b + c.carry:
            return f"{name}: {c.a}+{c.b}+{c.carry} is not {c.stated}."
    if len(got) < len(want):
        place = _PLACES[min(len(got) + 1, len(_PLACES)) - 1]
        return f"Column {len(got) + 1} ({place}) is missing: add the {place} digits and the carry in."
    final = extract_answer_value(completion[completion.find("####") :]) if "####" in completion else None
    last = want[-1].a + want[-1].b + want[-1].carry
    if final == int(str(last) + "".join(str((c.a + c.b + c.carry) % 10) for c in reversed(want[:-1]))):
        return None
    return "The answer is the last column's sum followed by the last digit of each column before it, last to first."


def locate_mistake(
    completion: str,
    task: Mapping[str, Any] | None,
    template: str = FALSE_STEP,
    hidden_template: str = FALSE_STEP_HIDDEN,
) -> str | None:
    """The hint that locates the first mistake of ``completion`` for ``task``, or ``None`` if none can be named."""
    worked = _worked(completion)
    solution = (task or {}).get("solution") or (task or {}).get("target")
    want = parse_columns(_worked(solution)) if isinstance(solution, str) else []
    if want:
        got = parse_columns(worked)
        return _column_mistake(got, want, completion) if got else None
    steps = parse_steps(worked)
    gold_steps, gold = _gold(task)
    for i, s in enumerate(steps, 1):
        if s.holds:
            continue
        fields = {"index": i, "stated": format_value(s.stated), "expression": _expression(s)}
        if s.value is not None and gold is not None and s.value == gold:
            return hidden_template.format(equation=_expression(s), **fields)
        return template.format(equation=s.shown(), **fields)
    if not steps or not gold_steps:
        return None
    for i, (got, want) in enumerate(zip(steps, gold_steps, strict=False), 1):
        if got.key == want.key:
            continue
        text = _used_wrongly(i, got, want)
        if text:
            return text
    if len(steps) < len(gold_steps):
        return f"Step {len(steps) + 1} is missing: the question needs {len(gold_steps)} steps."
    final = extract_answer_value(completion[completion.find("####") :]) if "####" in completion else None
    if final is not None and final != steps[-1].stated and steps[-1].value == gold:
        return "The final answer is not the result of the last step."
    return None


def false_step_attempt(solution: str, rng: Any) -> str | None:
    """``solution`` with one stated result made false (off by 1-3) and the rest carried on from it.

    The wrong value replaces the result where it is stated and where later steps use it; the final
    answer becomes what the carried-on steps give. ``None`` when the solution states no equation.
    A training example of the mistake ``step_check`` locates (``sft.hint_kinds: {step_check: ...}``).
    """
    columns = parse_columns(_worked(solution))
    if columns:  # one column's sum made false, the later carries and the answer carried on from it
        k, carry, lines, digits = rng.randrange(len(columns)), 0, [], []
        for i, c in enumerate(columns):
            total = c.a + c.b + carry
            if i == k:
                total = rng.choice([t for t in range(max(0, total - 3), total + 4) if t != total])
            lines.append(f"{c.a}+{c.b}+{carry}={total}")
            digits.append(str(total % 10))
            carry = total // 10
        return " " + "\n".join(lines) + f"\n#### {int(str(carry) + ''.join(reversed(digits)))}"
    steps = parse_steps(_worked(solution))
    if not steps:
        return None
    k = rng.randrange(len(steps))
    delta = rng.choice([-3, -2, -1, 1, 2, 3])
    if steps[k].stated + delta < 0:
        delta = abs(delta)
    lines: list[str] = []
    prev_true: Fraction | None = None
    prev_new: Fraction | None = None
    new: Fraction | None = None
    for i, s in enumerate(steps):
        a = prev_new if prev_true is not None and prev_new is not None and s.a == prev_true else s.a
        new = Step(a, s.op, s.b, s.stated, s.start, s.text).value if i != k else steps[k].stated + delta
        if new is None:
            return None
        lines.append(f"{format_value(a)} {s.op} {format_value(s.b)} = {format_value(new)}")
        prev_true, prev_new = s.stated, new
    return " " + "\n".join(lines) + f"\n#### {format_value(new)}"  # type: ignore[arg-type]


class StepCheckHintProvider(HintProvider):
    """Recompute each stated equation and name the first false one (see the module docstring)."""

    name = "step_check"

    def __init__(
        self, *, fallback: Any = "raw_error", template: str = FALSE_STEP, hidden_template: str = FALSE_STEP_HIDDEN
    ) -> None:
        for what, tpl in (("template", template), ("hidden_template", hidden_template)):
            try:
                tpl.format(index=1, equation="", stated="", expression="")
            except (KeyError, IndexError, ValueError) as e:
                raise ValueError(
                    f"{what} {tpl!r} has an unknown field {e}; use {{index}}, {{equation}}, {{stated}}, {{expression}}"
                ) from None
        self.template = template
        self.hidden_template = hidden_template
        self.fallback = None if fallback in (None, "none") else build_hint_provider(fallback)

    def hint(self, request: HintRequest) -> str | None:
        feedback, completion = request.failure, request.completion
        if feedback is None:
            return None
        text = None
        if completion is not None and feedback.kind == "wrong_answer":
            text = locate_mistake(prompt_text(completion), request.task, self.template, self.hidden_template)
        if text is None and self.fallback is not None:
            return self.fallback.hints([request])[0]
        return text
