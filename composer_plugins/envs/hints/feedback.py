"""Hints from the env's feedback alone: a fixed text per feedback kind (``template``) or the verifier's own words."""

from __future__ import annotations

import string
from collections.abc import Mapping
from typing import Any

from composer_plugins.envs.base import Feedback
from composer_plugins.envs.hints.contract import HintProvider, HintRequest

#: Hint text per feedback kind. Fields: any key of ``feedback.details`` plus ``message`` and the
#: derived ``{expected_actual}``, ``{at_test}``, ``{at_line}``, ``{reveal}`` (empty when unknown).
DEFAULT_TEMPLATES: dict[str, str] = {
    "wrong_answer": "Your final answer {got} is not correct{reveal}. Re-read the question and re-check each "
    "calculation step.",
    "no_answer": "Finish with the final answer on its own line, written as '#### <number>'.",
    "test_failure": "The test `{test}` fails{expected_actual}. Fix your code for this case.",
    "syntax_error": "Your code has a syntax error{at_line}: {message}. Write complete, valid Python.",
    "runtime_error": "Your code raises {error}{at_test}: {message}. Handle this case correctly.",
    "timeout": "Your code takes too long{at_test}: make sure every loop terminates and use an efficient algorithm.",
    "resource_limit": "Your code uses too much memory or prints too much output. Keep it lean.",
    "regression": "Your change breaks `{test}`, which passed before. Keep the existing behaviour working.",
    "tool_error": "The tool call failed: {message}. Check the tool name and arguments and try again.",
    "no_code": "Answer with the complete code in one ```python block.",
    "tampered": "Do not interfere with the tests or the test harness; solve the task itself.",
}


class _Fields(dict[str, Any]):
    def __missing__(self, key: str) -> str:
        return ""


def _short(text: Any, limit: int) -> str:
    s = "" if text is None else str(text)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _fields(feedback: Feedback, reveal_answer: bool, limit: int = 400) -> _Fields:
    d = feedback.details or {}
    f = _Fields({k: _short(v, limit) for k, v in d.items() if isinstance(v, str | int | float) or v is None})
    f["message"] = _short(d.get("message") or feedback.message, limit)
    f["kind"] = feedback.kind
    exp, act = d.get("expected"), d.get("actual")
    f["expected_actual"] = (
        f": expected {_short(exp, 200)}, got {_short(act, 200)}"
        if act is not None
        else (f": {_short(d.get('message'), limit)}" if d.get("message") else "")
    )
    f["at_test"] = f" in `{_short(d.get('test'), 200)}`" if d.get("test") else ""
    f["at_line"] = f" on line {d['lineno']}" if d.get("lineno") else ""
    f["reveal"] = f" (the correct answer is {exp})" if reveal_answer and exp is not None else ""
    if f.get("got") in (None, "", "None"):
        f["got"] = ""
    return f


class TemplateHintProvider(HintProvider):
    """Fixed hint text per feedback kind (no model calls).

    ``templates`` overrides :data:`DEFAULT_TEMPLATES` per kind; ``default`` is the text for kinds without a
    template (None: no hint).
    """

    name = "template"

    def __init__(
        self,
        templates: Mapping[str, str] | None = None,
        *,
        reveal_answer: bool = False,
        default: str | None = "{message}",
    ) -> None:
        self.templates = {**DEFAULT_TEMPLATES, **(templates or {})}
        for kind, tpl in self.templates.items():
            try:
                list(string.Formatter().parse(tpl))
            except ValueError as e:
                from composer_plugins.core.errors import ConfigError

                raise ConfigError(f"bad template: {e}", key=f"templates.{kind}") from None
        self.reveal_answer = reveal_answer
        self.default = default

    def hint(self, request: HintRequest) -> str | None:
        feedback = request.failure
        tpl = None if feedback is None else self.templates.get(feedback.kind, self.default)
        if tpl is None:
            return None
        text = string.Formatter().vformat(tpl, (), _fields(feedback, self.reveal_answer))
        text = text.replace("``", "").replace(" .", ".").replace("  ", " ").strip()
        return text or None


class RawErrorHintProvider(HintProvider):
    """The verifier's raw error as the hint: assertion message, expected/actual, traceback, failing test.

    ``max_chars`` truncates the hint (keeping the end of tracebacks).
    """

    name = "raw_error"

    def __init__(self, *, max_chars: int = 1500, reveal_answer: bool = False) -> None:
        self.max_chars = max_chars
        self.reveal_answer = reveal_answer

    def hint(self, request: HintRequest) -> str | None:
        feedback = request.failure
        if feedback is None:
            return None
        d = feedback.details or {}
        parts: list[str] = []
        if feedback.kind in ("wrong_answer", "no_answer"):
            parts.append(feedback.message)
            if self.reveal_answer and d.get("expected") is not None:
                parts.append(f"Expected: {d['expected']}")
        else:
            if d.get("test"):
                parts.append(f"Failing test: {d['test']}")
            if d.get("error") or d.get("message"):
                parts.append(f"{d.get('error') or 'Error'}: {d.get('message') or ''}".rstrip(": "))
            if d.get("actual") is not None:
                parts.append(f"Expected {d.get('expected')}, got {d.get('actual')}")
            if d.get("traceback"):
                parts.append(str(d["traceback"]).strip())
            if d.get("regressed"):
                parts.append("Now failing (passed before): " + ", ".join(map(str, d["regressed"][:5])))
            if not parts:
                parts.append(feedback.message or str(d.get("stderr", ""))[-self.max_chars :])
        text = "\n".join(p for p in parts if p).strip()
        if len(text) > self.max_chars:
            text = "..." + text[-(self.max_chars - 3) :]
        return text or None
