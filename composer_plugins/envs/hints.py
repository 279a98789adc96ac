"""Hint providers: turn an env's structured :class:`~composer_plugins.envs.base.Feedback` into a hint.

The hint is the "textual feedback" of targeted RL / hint self-distillation: it is inserted
into the context at the failing turn (:func:`build_teacher_context`) to form the teacher
context, under which the same model scores the student's attempt.

Built-ins, from cheapest to richest (registry kind ``hints``):

* ``template``: one fixed text per feedback kind (wrong answer, failing test with its
  assertion, syntax/runtime error, timeout, tool error, regression ...);
* ``raw_error``: the verifier's own words (assertion message, expected/actual, traceback);
* ``llm_teacher``: a teacher model writes a short hint from the problem, the attempt and the
  feedback. The teacher is built by name through the ``teachers`` registry, or is any object
  with ``async def complete(messages)`` (result with ``.text``) or a sync ``generate(messages)``.
  Off unless configured; falls back to ``template`` when the teacher fails;
* ``chain``: the first hint any of several providers gives.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import string
import threading
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from composer_plugins.envs.base import Feedback, prompt_text

__all__ = [
    "DEFAULT_TEMPLATES",
    "ChainHintProvider",
    "HintProvider",
    "LLMTeacherHintProvider",
    "RawErrorHintProvider",
    "TemplateHintProvider",
    "build_hint_provider",
    "build_teacher_context",
    "hint_request_messages",
]

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
    f["expected_actual"] = f": expected {_short(exp, 200)}, got {_short(act, 200)}" if act is not None else (
        f": {_short(d.get('message'), limit)}" if d.get("message") else ""
    )  # fmt: skip
    f["at_test"] = f" in `{_short(d.get('test'), 200)}`" if d.get("test") else ""
    f["at_line"] = f" on line {d['lineno']}" if d.get("lineno") else ""
    f["reveal"] = f" (the correct answer is {exp})" if reveal_answer and exp is not None else ""
    if f.get("got") in (None, "", "None"):
        f["got"] = ""
    return f


class HintProvider:
    """Base class: ``hint(feedback, prompt=..., completion=..., task=...) -> str | None``.

    ``None`` means "no hint" (the completion was correct, or nothing useful can be said).
    """

    name: ClassVar[str] = "hint"

    def hint(
        self, feedback: Feedback, *, prompt: Any = None, completion: Any = None, task: Mapping[str, Any] | None = None
    ) -> str | None:
        """One hint."""
        raise NotImplementedError

    async def ahint(
        self, feedback: Feedback, *, prompt: Any = None, completion: Any = None, task: Mapping[str, Any] | None = None
    ) -> str | None:
        """Async :meth:`hint` (the default just calls it)."""
        return self.hint(feedback, prompt=prompt, completion=completion, task=task)

    def hints(
        self,
        feedbacks: Sequence[Feedback],
        prompts: Sequence[Any] | None = None,
        completions: Sequence[Any] | None = None,
        tasks: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[str | None]:
        """Hints for a batch (providers that call models do this concurrently)."""
        n = len(feedbacks)
        return [
            self.hint(
                feedbacks[i],
                prompt=prompts[i] if prompts else None,
                completion=completions[i] if completions else None,
                task=tasks[i] if tasks else None,
            )
            for i in range(n)
        ]

    def __call__(self, feedback: Feedback, **kw: Any) -> str | None:
        return self.hint(feedback, **kw)


class TemplateHintProvider(HintProvider):
    """Fixed hint text per feedback kind (no model calls).

    Args:
        templates: per-kind overrides of :data:`DEFAULT_TEMPLATES` (``str.format`` fields from the feedback).
        reveal_answer: mention the expected answer in wrong-answer hints.
        default: text for kinds without a template (None: no hint).
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

    def hint(
        self, feedback: Feedback, *, prompt: Any = None, completion: Any = None, task: Mapping[str, Any] | None = None
    ) -> str | None:
        if feedback.ok or feedback.kind in ("unscorable", "sandbox_error"):
            return None
        tpl = self.templates.get(feedback.kind, self.default)
        if tpl is None:
            return None
        text = string.Formatter().vformat(tpl, (), _fields(feedback, self.reveal_answer))
        text = text.replace("``", "").replace(" .", ".").replace("  ", " ").strip()
        return text or None


class RawErrorHintProvider(HintProvider):
    """The verifier's raw error as the hint: assertion message, expected/actual, traceback, failing test.

    Args:
        max_chars: truncate the hint to this many characters (keeping the end of tracebacks).
        reveal_answer: for wrong answers, say what the expected answer was.
    """

    name = "raw_error"

    def __init__(self, *, max_chars: int = 1500, reveal_answer: bool = False) -> None:
        self.max_chars = max_chars
        self.reveal_answer = reveal_answer

    def hint(
        self, feedback: Feedback, *, prompt: Any = None, completion: Any = None, task: Mapping[str, Any] | None = None
    ) -> str | None:
        if feedback.ok or feedback.kind in ("unscorable", "sandbox_error"):
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


HINT_SYSTEM_PROMPT = (
    "You are a patient tutor. A student attempted a task and a verifier reported what went wrong. "
    "Write ONE short hint (at most two sentences) that points the student at the mistake. "
    "Do not give the final answer or the full solution."
)


def hint_request_messages(
    feedback: Feedback,
    *,
    prompt: Any = None,
    completion: Any = None,
    reveal_answer: bool = False,
    system_prompt: str = HINT_SYSTEM_PROMPT,
    max_chars: int = 4000,
) -> list[dict[str, str]]:
    """The chat messages an LLM teacher gets to write a hint."""
    d = {k: v for k, v in (feedback.details or {}).items() if k not in ("stdout", "stderr") and v not in (None, "")}
    if not reveal_answer and feedback.kind in ("wrong_answer", "no_answer"):
        d.pop("expected", None)
    body = (
        f"Task:\n{_short(prompt_text(prompt), max_chars)}\n\n"
        f"Student's attempt:\n{_short(prompt_text(completion), max_chars)}\n\n"
        f"Verifier feedback ({feedback.kind}): {feedback.message}\n"
        f"Details: {_short(json.dumps(d, default=str), 1500)}\n\n"
        "Write the hint."
    )
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": body}]


def _result_text(result: Any) -> str:
    if result is None:
        return ""
    if isinstance(result, str):
        return result
    text = getattr(result, "text", None)
    if text is not None:
        return str(text)
    if isinstance(result, Mapping):
        return str(result.get("text") or result.get("content") or "")
    return str(result)


class LLMTeacherHintProvider(HintProvider):
    """A teacher model writes the hint from the task, the attempt and the verifier's feedback.

    Args:
        teacher: a registered teacher name (built with ``teacher_kwargs`` through the ``teachers``
            registry) or an object with ``async def complete(messages)`` or ``generate(messages)``.
        reveal_answer: let the teacher see the expected answer.
        system_prompt: instructions for the teacher.
        max_chars: truncate hints to this length.
        fallback: provider used when the teacher fails or returns nothing (None: no hint).
        max_concurrency: teacher calls in flight in :meth:`hints`.
    """

    name = "llm_teacher"

    def __init__(
        self,
        teacher: Any,
        *,
        teacher_kwargs: Mapping[str, Any] | None = None,
        reveal_answer: bool = False,
        system_prompt: str = HINT_SYSTEM_PROMPT,
        max_chars: int = 600,
        fallback: str | HintProvider | None = "template",
        max_concurrency: int = 8,
    ) -> None:
        if isinstance(teacher, str):
            from composer_plugins import build

            teacher = build("teachers", teacher, **dict(teacher_kwargs or {}))
        if not (callable(getattr(teacher, "complete", None)) or callable(getattr(teacher, "generate", None))):
            raise TypeError(f"teacher {teacher!r} has neither complete(messages) nor generate(messages)")
        self.teacher = teacher
        self.reveal_answer = reveal_answer
        self.system_prompt = system_prompt
        self.max_chars = max_chars
        self.fallback = build_hint_provider(fallback) if fallback is not None else None
        self.max_concurrency = max(1, max_concurrency)
        self.errors: list[str] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    # -- teacher calls ---------------------------------------------------------------------------
    async def _ask(self, messages: list[dict[str, str]]) -> str:
        complete = getattr(self.teacher, "complete", None)
        if complete is not None and inspect.iscoroutinefunction(complete):
            return _result_text(await complete(messages))
        generate = getattr(self.teacher, "generate", None) or complete
        return _result_text(await asyncio.to_thread(generate, messages))

    async def ahint(
        self, feedback: Feedback, *, prompt: Any = None, completion: Any = None, task: Mapping[str, Any] | None = None
    ) -> str | None:
        if feedback.ok or feedback.kind in ("unscorable", "sandbox_error"):
            return None
        messages = hint_request_messages(
            feedback, prompt=prompt, completion=completion, reveal_answer=self.reveal_answer,
            system_prompt=self.system_prompt,
        )  # fmt: skip
        text = ""
        try:
            text = (await self._ask(messages)).strip()
        except Exception as e:  # a failing teacher must not stop training: fall back
            self.errors.append(f"{type(e).__name__}: {e}")
        if not text:
            return (
                self.fallback.hint(feedback, prompt=prompt, completion=completion, task=task) if self.fallback else None
            )
        return _short(text, self.max_chars)

    def _run(self, coro: Any) -> Any:
        """Run ``coro`` on this provider's own event loop thread (teachers keep their sessions on one loop)."""
        with self._lock:
            if self._loop is None or self._thread is None or not self._thread.is_alive():
                loop = asyncio.new_event_loop()
                ready = threading.Event()

                def run() -> None:
                    asyncio.set_event_loop(loop)
                    ready.set()
                    loop.run_forever()

                self._thread = threading.Thread(target=run, name="llm-hint-loop", daemon=True)
                self._thread.start()
                ready.wait()
                self._loop = loop
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def hint(
        self, feedback: Feedback, *, prompt: Any = None, completion: Any = None, task: Mapping[str, Any] | None = None
    ) -> str | None:
        return self._run(self.ahint(feedback, prompt=prompt, completion=completion, task=task))

    def hints(
        self,
        feedbacks: Sequence[Feedback],
        prompts: Sequence[Any] | None = None,
        completions: Sequence[Any] | None = None,
        tasks: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[str | None]:
        sem_holder: dict[str, asyncio.Semaphore] = {}

        async def one(i: int) -> str | None:
            sem = sem_holder.setdefault("s", asyncio.Semaphore(self.max_concurrency))
            async with sem:
                return await self.ahint(
                    feedbacks[i],
                    prompt=prompts[i] if prompts else None,
                    completion=completions[i] if completions else None,
                    task=tasks[i] if tasks else None,
                )

        async def all_() -> list[str | None]:
            return list(await asyncio.gather(*(one(i) for i in range(len(feedbacks)))))

        return self._run(all_())

    def close(self) -> None:
        """Close the teacher (``aclose``) and stop the event loop thread."""
        aclose = getattr(self.teacher, "aclose", None)
        if self._loop is not None:
            if aclose is not None and inspect.iscoroutinefunction(aclose):
                with contextlib.suppress(Exception):
                    self._run(aclose())
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._thread is not None:
                self._thread.join(timeout=5)
            self._loop = None


class ChainHintProvider(HintProvider):
    """The first non-empty hint of several providers (names, config dicts or objects)."""

    name = "chain"

    def __init__(self, providers: Sequence[Any]) -> None:
        if not providers:
            raise ValueError("chain needs at least one provider")
        self.providers = [build_hint_provider(p) for p in providers]

    def hint(
        self, feedback: Feedback, *, prompt: Any = None, completion: Any = None, task: Mapping[str, Any] | None = None
    ) -> str | None:
        for p in self.providers:
            h = p.hint(feedback, prompt=prompt, completion=completion, task=task)
            if h:
                return h
        return None


def build_hint_provider(spec: Any) -> HintProvider:
    """A hint provider from a name (``"template"``), ``{"name": ..., **kwargs}`` or an object."""
    if isinstance(spec, HintProvider) or (
        not isinstance(spec, str | Mapping) and callable(getattr(spec, "hint", None))
    ):
        return spec  # type: ignore[no-any-return]
    from composer_plugins.core.config import build_component

    return build_component("hints", spec, key="hints")  # type: ignore[no-any-return]


def _insert_before_cue(text: str, block: str) -> str:
    """Put ``block`` before a final answer cue line (``Answer:``), else at the end."""
    stripped = text.rstrip()
    head, sep, last = stripped.rpartition("\n")
    if sep and len(last) <= 24 and last.rstrip().endswith(":"):
        return f"{head}\n{block}\n{last}{text[len(stripped) :]}"
    return f"{stripped}\n\n{block}"


def build_teacher_context(
    prompt: str | Sequence[Mapping[str, Any]],
    hint: str | None,
    *,
    failing_turn: int | None = None,
    template: str = "Hint: {hint}",
    role: str = "user",
) -> str | list[dict[str, Any]]:
    """The teacher context: the student's context with the hint inserted at the failing turn.

    * A text prompt: the hint goes before a final answer cue line (``...\\nAnswer:``) if there
      is one, else at the end: ``"Question: ...\\nHint: ...\\nAnswer:"``.
    * Chat messages: the context is cut right before the failing assistant turn
      (``failing_turn``, an index into ``messages``; default: the last assistant message, or the
      next turn if the last message is not the assistant's); the hint is appended to the
      user/tool message just before it, or added as a new ``role`` message.

    The student's (failing) completion is what the teacher then scores in this context.
    With ``hint`` None or empty the context is returned unchanged.
    """
    if isinstance(prompt, str):
        if not hint:
            return prompt
        return _insert_before_cue(prompt, template.format(hint=hint))
    messages = [dict(m) for m in prompt]
    if failing_turn is None:
        failing_turn = len(messages) - 1 if messages and messages[-1].get("role") == "assistant" else len(messages)
    if not 0 <= failing_turn <= len(messages):
        raise IndexError(f"failing_turn {failing_turn} is outside the conversation (0..{len(messages)})")
    if failing_turn < len(messages) and messages[failing_turn].get("role") != "assistant":
        raise ValueError(
            f"message {failing_turn} is a {messages[failing_turn].get('role')!r} turn, not the assistant's"
        )
    ctx = messages[:failing_turn]
    if not hint:
        return ctx
    block = template.format(hint=hint)
    if ctx and ctx[-1].get("role") in ("user", "tool") and isinstance(ctx[-1].get("content"), str):
        ctx[-1]["content"] = f"{ctx[-1]['content'].rstrip()}\n\n{block}"
    else:
        ctx.append({"role": role, "content": block})
    return ctx
