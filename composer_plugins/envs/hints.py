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
* ``chain``: the first hint any of several providers gives;
* ``demonstration``: a successful sibling's completion from the same rollout group (SDPO's
  self-teacher), with the feedback when configured or when no sibling succeeded.

One contract (as simonw/llm's register hooks: one call shape, older shapes adapted once): a provider
gets one :class:`HintRequest` per row — prompt, completion, the env's feedback, the task, the reward and
the row's rollout group (:class:`SiblingGroup`) — and implements ``hints(requests) -> list[str | None]``
(:meth:`HintProvider.hint` per row is the simple form). A provider that reads the group says so with
``reads_groups = True``. Older providers (``hint(feedback, *, prompt, completion, task[, group])`` or
``hints(feedbacks, prompts, completions, tasks[, groups=])``, objects or plain callables) are adapted once
when the provider is built (:func:`build_hint_provider` / :func:`as_hint_provider`); nothing inspects a
signature per call.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import json
import random
import re
import string
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from composer_plugins.envs.base import Feedback, prompt_text

__all__ = [
    "DEFAULT_TEMPLATES",
    "ChainHintProvider",
    "DemonstrationHintProvider",
    "HintProvider",
    "HintRequest",
    "LLMTeacherHintProvider",
    "RawErrorHintProvider",
    "SiblingGroup",
    "TemplateHintProvider",
    "as_hint_provider",
    "build_hint_provider",
    "build_teacher_context",
    "hint_request_messages",
    "hint_requests",
    "reads_groups",
    "sibling_groups",
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


@dataclass(frozen=True)
class SiblingGroup:
    """One row's view of its rollout group: the ``G`` completions sampled for the same prompt.

    Attributes:
        completions: every completion of the group, this row's included (text or chat messages).
        rewards: their rewards, in the same order.
        index: this row's position in the group.
        success_threshold: reward at or above which a completion counts as successful (the
            rollout's ``success_threshold``; a provider may apply its own).
    """

    completions: tuple[Any, ...]
    rewards: tuple[float, ...]
    index: int
    success_threshold: float = 1.0

    def __post_init__(self) -> None:
        if len(self.completions) != len(self.rewards):
            raise ValueError(f"a group has {len(self.completions)} completions but {len(self.rewards)} rewards")
        if not 0 <= self.index < len(self.completions):
            raise IndexError(f"row index {self.index} is outside its group of {len(self.completions)}")

    @property
    def completion(self) -> Any:
        """This row's own completion."""
        return self.completions[self.index]

    @property
    def reward(self) -> float:
        """This row's own reward."""
        return self.rewards[self.index]

    def successful_siblings(self, threshold: float | None = None) -> list[int]:
        """Indices of the *other* completions whose reward is at least ``threshold`` (default: the group's).

        Never this row's own index: a teacher conditioned on the row's own success would only
        teach the student to copy itself.
        """
        thr = self.success_threshold if threshold is None else threshold
        return [j for j, r in enumerate(self.rewards) if j != self.index and r is not None and float(r) >= thr]


def sibling_groups(
    completions: Sequence[Any], rewards: Sequence[float], group_size: int, success_threshold: float = 1.0
) -> list[SiblingGroup]:
    """One :class:`SiblingGroup` per row of a rollout whose rows ``i`` form groups ``i // group_size``."""
    n = len(completions)
    if len(rewards) != n:
        raise ValueError(f"{n} completions but {len(rewards)} rewards")
    if group_size < 1 or n % group_size:
        raise ValueError(f"{n} rows do not split into groups of {group_size}")
    out: list[SiblingGroup] = []
    for start in range(0, n, group_size):
        comps = tuple(completions[start : start + group_size])
        rs = tuple(float(r) for r in rewards[start : start + group_size])
        out.extend(SiblingGroup(comps, rs, j, float(success_threshold)) for j in range(group_size))
    return out


@dataclass(frozen=True)
class HintRequest:
    """What a hint provider is asked about one row: a failed (or any) completion and its context.

    Attributes:
        prompt: the prompt the completion answers (text or chat messages).
        completion: the student's completion (text or chat messages).
        feedback: the env's :class:`~composer_plugins.envs.base.Feedback` on it (``None``: none).
        task: the task dict (the env's fields: ``answer``, ``tests`` ...).
        reward: the completion's reward.
        group: the row's rollout group (its siblings and their rewards), ``None`` when not sampled.
    """

    prompt: Any = None
    completion: Any = None
    feedback: Feedback | None = None
    task: Mapping[str, Any] | None = None
    reward: float | None = None
    group: SiblingGroup | None = None


def _needs_hint(feedback: Feedback | None) -> bool:
    """A failed attempt the env judged (not correct, not one the verifier could not judge)."""
    return feedback is not None and feedback.needs_hint


class HintProvider:
    """Base class of hint providers: ``hint(request) -> str | None`` per row, ``hints(requests)`` per batch.

    ``None`` means "no hint" (the completion was correct, or nothing useful can be said). Providers
    that call models override :meth:`hints` (concurrent calls); providers that read the rollout
    group set ``reads_groups = True`` (callers then gather the group's siblings across processes).
    """

    name: ClassVar[str] = "hint"
    #: True when the provider reads :attr:`HintRequest.group`.
    reads_groups: ClassVar[bool] = False

    def hint(self, request: HintRequest) -> str | None:
        """One hint."""
        raise NotImplementedError(f"{type(self).__name__} must implement hint(request) or hints(requests)")

    async def ahint(self, request: HintRequest) -> str | None:
        """Async :meth:`hint` (the default just calls it)."""
        return self.hint(request)

    def hints(self, requests: Sequence[HintRequest]) -> list[str | None]:
        """Hints for a batch of requests, one per request."""
        return [self.hint(r) for r in requests]

    def __call__(self, request: HintRequest) -> str | None:
        return self.hint(request)

    def kinds(self, hints: Sequence[Any]) -> list[str | None]:
        """Which provider gave each of ``hints`` (this provider's last :meth:`hints` call): its name, or ``None``.

        A :class:`ChainHintProvider` names the member that answered, so a run can log each kind's share.
        """
        return [self.name if h else None for h in hints]


# -- older provider shapes, adapted once when the provider is built ---------------------------------
class _LegacyRows(HintProvider):
    """A ``hint(feedback, *, prompt, completion, task[, group])`` callable behind the request contract."""

    name = "legacy"

    def __init__(self, fn: Any, with_group: bool, source: Any) -> None:
        self.fn, self.with_group, self.source = fn, with_group, source
        self.reads_groups = with_group  # type: ignore[misc]

    def hint(self, request: HintRequest) -> str | None:
        kw: dict[str, Any] = {"prompt": request.prompt, "completion": request.completion, "task": request.task}
        if self.with_group:
            kw["group"] = request.group
        return self.fn(request.feedback, **kw)  # type: ignore[no-any-return]


class _LegacyBatch(HintProvider):
    """A ``hints(feedbacks, prompts, completions, tasks[, groups=])`` method behind the request contract."""

    name = "legacy"

    def __init__(self, fn: Any, with_groups: bool, source: Any) -> None:
        self.fn, self.with_groups, self.source = fn, with_groups, source
        self.reads_groups = with_groups  # type: ignore[misc]

    def hints(self, requests: Sequence[HintRequest]) -> list[str | None]:
        cols = (
            [r.feedback for r in requests],
            [r.prompt for r in requests],
            [r.completion for r in requests],
            [r.task for r in requests],
        )
        if self.with_groups:
            return list(self.fn(*cols, groups=[r.group for r in requests]))
        return list(self.fn(*cols))

    def hint(self, request: HintRequest) -> str | None:
        return self.hints([request])[0]


def _params(fn: Any) -> list[inspect.Parameter]:
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return []


def _takes(params: Sequence[inspect.Parameter], name: str) -> bool:
    return any(p.name == name and p.kind is not p.VAR_POSITIONAL for p in params) or any(
        p.kind is p.VAR_KEYWORD for p in params
    )


def _first_is(params: Sequence[inspect.Parameter], name: str) -> bool:
    return bool(params) and params[0].name == name


def as_hint_provider(obj: Any) -> HintProvider:
    """``obj`` behind the one request contract, adapted once (at build time, never per call).

    Accepted: a provider with ``hints(requests)`` / ``hint(request)`` (returned as is); the older
    shapes — an object with ``hints(feedbacks, prompts, completions, tasks[, groups=])`` or
    ``hint(feedback, *, prompt, completion, task[, group])``, or such a plain callable — wrapped.
    """
    if isinstance(obj, HintProvider):
        cls = type(obj)
        own_hints = cls.hints is not HintProvider.hints
        own_hint = cls.hint is not HintProvider.hint
        if own_hints and not _first_is(_params(obj.hints), "requests"):
            return _LegacyBatch(obj.hints, _takes(_params(obj.hints), "groups"), obj)
        if own_hint and not own_hints and not _first_is(_params(obj.hint), "request"):
            return _LegacyRows(obj.hint, _takes(_params(obj.hint), "group"), obj)
        return obj
    hints_fn = getattr(obj, "hints", None)
    if callable(hints_fn):
        if _first_is(_params(hints_fn), "requests"):
            return _Wrapped(obj, batch=hints_fn)
        return _LegacyBatch(hints_fn, _takes(_params(hints_fn), "groups"), obj)
    fn = getattr(obj, "hint", None) or obj
    if not callable(fn):
        raise TypeError(f"{obj!r} is not a hint provider: give an object with hints(requests) or hint(request)")
    if _first_is(_params(fn), "request"):
        return _Wrapped(obj, row=fn)
    return _LegacyRows(fn, _takes(_params(fn), "group"), obj)


class _Wrapped(HintProvider):
    """A duck-typed provider (not a :class:`HintProvider` subclass) already on the request contract."""

    name = "wrapped"

    def __init__(self, source: Any, *, batch: Any = None, row: Any = None) -> None:
        self.source, self._batch, self._row = source, batch, row
        self.reads_groups = bool(getattr(source, "reads_groups", False))  # type: ignore[misc]

    def hints(self, requests: Sequence[HintRequest]) -> list[str | None]:
        if self._batch is not None:
            return list(self._batch(list(requests)))
        return [self._row(r) for r in requests]

    def hint(self, request: HintRequest) -> str | None:
        return self.hints([request])[0]


def reads_groups(provider: Any) -> bool:
    """Whether ``provider`` (built by :func:`build_hint_provider`) reads the rollout group."""
    return bool(getattr(provider, "reads_groups", False))


def hint_requests(
    feedbacks: Sequence[Any],
    prompts: Sequence[Any] | None = None,
    completions: Sequence[Any] | None = None,
    tasks: Sequence[Mapping[str, Any]] | None = None,
    groups: Sequence[SiblingGroup | None] | None = None,
) -> list[HintRequest]:
    """One :class:`HintRequest` per row from columns (the rows' rewards taken from their groups)."""
    n = len(feedbacks)
    for what, col in (("prompts", prompts), ("completions", completions), ("tasks", tasks), ("groups", groups)):
        if col is not None and len(col) != n:
            raise ValueError(f"{len(col)} {what} for {n} rows")
    out = []
    for i in range(n):
        g = groups[i] if groups is not None else None
        out.append(
            HintRequest(
                prompt=prompts[i] if prompts is not None else None,
                completion=completions[i] if completions is not None else None,
                feedback=feedbacks[i],
                task=tasks[i] if tasks is not None else None,
                reward=g.reward if g is not None else None,
                group=g,
            )
        )
    return out


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

    def hint(self, request: HintRequest) -> str | None:
        feedback = request.feedback
        if feedback is None or not feedback.needs_hint:
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

    def hint(self, request: HintRequest) -> str | None:
        feedback = request.feedback
        if feedback is None or not feedback.needs_hint:
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

    async def ahint(self, request: HintRequest) -> str | None:
        feedback = request.feedback
        if feedback is None or not feedback.needs_hint:
            return None
        messages = hint_request_messages(
            feedback,
            prompt=request.prompt,
            completion=request.completion,
            reveal_answer=self.reveal_answer,
            system_prompt=self.system_prompt,
        )
        text = ""
        try:
            text = (await self._ask(messages)).strip()
        except Exception as e:  # a failing teacher must not stop training: fall back
            self.errors.append(f"{type(e).__name__}: {e}")
        if not text:
            return self.fallback.hints([request])[0] if self.fallback else None
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

    def hint(self, request: HintRequest) -> str | None:
        return self._run(self.ahint(request))  # type: ignore[no-any-return]

    def hints(self, requests: Sequence[HintRequest]) -> list[str | None]:
        sem_holder: dict[str, asyncio.Semaphore] = {}

        async def one(r: HintRequest) -> str | None:
            sem = sem_holder.setdefault("s", asyncio.Semaphore(self.max_concurrency))
            async with sem:
                return await self.ahint(r)

        async def all_() -> list[str | None]:
            return list(await asyncio.gather(*(one(r) for r in requests)))

        return self._run(all_())  # type: ignore[no-any-return]

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
    """The first non-empty hint of several providers (names, config dicts or objects), tried in order.

    The order is the mixing rule: ``[demonstration (fallback: none), step_check]`` gives a demonstration
    where a sibling succeeded and step_check's located mistake otherwise; with step_check first (it hints
    every failure) the demonstration would never be used. :meth:`kinds` names the member that gave each
    hint, so a run logs each kind's share of the rows (``hint/fraction/<kind>``).
    """

    name = "chain"

    def __init__(self, providers: Sequence[Any]) -> None:
        if not providers:
            raise ValueError("chain needs at least one provider")
        self.providers = [build_hint_provider(p) for p in providers]
        self.reads_groups = any(reads_groups(p) for p in self.providers)  # type: ignore[misc]
        self._kinds: list[str | None] = []

    def hint(self, request: HintRequest) -> str | None:
        return self.hints([request])[0]

    def hints(self, requests: Sequence[HintRequest]) -> list[str | None]:
        out: list[str | None] = [None] * len(requests)
        kinds: list[str | None] = [None] * len(requests)
        todo = list(range(len(requests)))
        for p in self.providers:
            if not todo:
                break
            hs = p.hints([requests[i] for i in todo])
            ks = p.kinds(hs)
            for i, h, k in zip(todo, hs, ks, strict=True):
                if h:
                    out[i], kinds[i] = h, k
            todo = [i for i in todo if not out[i]]
        self._kinds = kinds
        return out

    def kinds(self, hints: Sequence[Any]) -> list[str | None]:
        if len(self._kinds) != len(hints):
            return super().kinds(hints)
        return [k if h else None for k, h in zip(self._kinds, hints, strict=True)]


#: SDPO's reprompting defaults (Hübotter et al. 2026), worded for the ``Hint: ...`` block of a teacher context.
#: ``{feedback}`` is empty, or the rendered ``feedback_template`` after a blank line.
DEMONSTRATION_TEMPLATE = "Correct solution:\n{demonstration}{feedback}\n\nCorrectly solve the original question."
FEEDBACK_TEMPLATE = "The following is feedback from your unsuccessful earlier attempt:\n{feedback}"
_PICKS = ("first", "shortest", "random")
_FALLBACKS = ("feedback", "none")
_ROWS = ("failed", "all")
_THINK = re.compile(r"<think>.*?</think>\s*", re.DOTALL)


def _check_template(tpl: str, allowed: set[str], what: str) -> None:
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(tpl) if f}
    except ValueError as e:
        raise ValueError(f"{what} is not a valid format string: {e}") from None
    unknown = sorted(fields - allowed)
    if unknown:
        raise ValueError(f"{what} uses unknown field {{{unknown[0]}}}; available: " + ", ".join(sorted(allowed)))


def _choice(value: str, valid: Sequence[str], what: str) -> str:
    if value in valid:
        return value
    from composer_plugins.core.errors import closest

    near = closest(str(value), valid)
    dym = f" Did you mean {near[0]!r}?" if near else ""
    raise ValueError(f"{what} {value!r} is not one of {', '.join(valid)}.{dym}")


class DemonstrationHintProvider(HintProvider):
    """A successful sibling's completion from the same rollout group as the hint (SDPO's self-teacher).

    For a failed row the hint shows another completion of the same prompt that succeeded
    (reward ``>= success_threshold``), never the row's own, through ``template``; with
    ``include_feedback`` the env's feedback on the failed attempt follows it. When no sibling
    succeeded (or no group is given) the hint is the feedback alone (``fallback: feedback``) or
    nothing (``fallback: none``).

    Args:
        success_threshold: reward at or above which a sibling counts as successful (SDPO: 0.5);
            ``None`` uses the rollout's ``success_threshold`` carried by the group.
        pick: which successful sibling: ``first`` (lowest index), ``shortest`` (fewest characters,
            ties to the lowest index) or ``random`` (seeded by ``seed`` and the group's contents,
            so the same rollout gets the same pick).
        seed: seed of ``pick: random``.
        max_chars: cut the demonstration to this many characters (its start is kept).
        template: the hint, with ``{demonstration}`` and ``{feedback}`` (empty unless
            ``include_feedback``; else a blank line and the rendered ``feedback_template``;
            appended at the end when the template has no ``{feedback}``).
        feedback_template: how the feedback is rendered, with ``{feedback}``.
        include_feedback: add the feedback after the demonstration (SDPO's default is to use
            feedback only when no sibling succeeded).
        fallback: ``feedback`` or ``none`` when no sibling succeeded.
        feedback: the provider that turns the env's feedback into text (name, config dict or
            object; ``raw_error`` by default, ``template`` for the fixed texts).
        strip_thinking: drop ``<think>...</think>`` blocks from the demonstration.
        rows: which rows get a hint: ``failed`` (the rows below the success threshold) or ``all``
            (SDPO's rule: every row with a successful sibling other than itself, successful rows
            included; a row without one gets the feedback fallback only if it failed).
    """

    name = "demonstration"
    reads_groups = True

    def __init__(
        self,
        *,
        success_threshold: float | None = 0.5,
        pick: str = "first",
        seed: int = 0,
        max_chars: int = 2000,
        template: str = DEMONSTRATION_TEMPLATE,
        feedback_template: str = FEEDBACK_TEMPLATE,
        include_feedback: bool = False,
        fallback: str = "feedback",
        feedback: Any = "raw_error",
        strip_thinking: bool = True,
        rows: str = "failed",
    ) -> None:
        self.pick = _choice(pick, _PICKS, "pick")
        self.rows = _choice(rows, _ROWS, "rows")
        self.fallback = _choice(fallback, _FALLBACKS, "fallback")
        if int(max_chars) < 1:
            raise ValueError(f"max_chars must be at least 1, got {max_chars!r}")
        _check_template(template, {"demonstration", "feedback"}, "template")
        if "{demonstration}" not in template:
            raise ValueError("template must contain {demonstration}")
        _check_template(feedback_template, {"feedback"}, "feedback_template")
        self.success_threshold = None if success_threshold is None else float(success_threshold)
        self.seed = int(seed)
        self.max_chars = int(max_chars)
        self.template = template
        self.feedback_template = feedback_template
        self.include_feedback = bool(include_feedback)
        self.strip_thinking = bool(strip_thinking)
        self.feedback_provider = build_hint_provider(feedback)

    def _threshold(self, group: SiblingGroup) -> float:
        return group.success_threshold if self.success_threshold is None else self.success_threshold

    def pick_sibling(self, group: SiblingGroup) -> int | None:
        """The index of the sibling whose completion is the demonstration (``None``: no sibling succeeded)."""
        ok = group.successful_siblings(self._threshold(group))
        if not ok:
            return None
        if self.pick == "first":
            return ok[0]
        if self.pick == "shortest":
            return min(ok, key=lambda j: (len(prompt_text(group.completions[j])), j))
        key = json.dumps([self.seed, group.index, [prompt_text(c) for c in group.completions]], default=str)
        return random.Random(hashlib.sha256(key.encode()).hexdigest()).choice(ok)

    def _demonstration(self, completion: Any) -> str:
        text = prompt_text(completion)
        if self.strip_thinking:
            text = _THINK.sub("", text)
        text = text.strip()
        return text if len(text) <= self.max_chars else text[: self.max_chars - 3].rstrip() + "..."

    def _feedback_text(self, request: HintRequest) -> str | None:
        return self.feedback_provider.hints([request])[0]

    def hint(self, request: HintRequest) -> str | None:
        feedback, group = request.feedback, request.group
        succeeded = group is not None and group.reward >= self._threshold(group)
        if succeeded and self.rows == "failed":
            return None  # the row itself succeeded: nothing to correct
        if not succeeded and feedback is not None and not feedback.needs_hint:
            return None  # correct by the env's judgement, or not judged at all
        j = self.pick_sibling(group) if group is not None else None
        if j is None:
            if succeeded or self.fallback == "none" or feedback is None:
                return None
            return self._feedback_text(request)
        fb = ""
        if self.include_feedback and feedback is not None and not succeeded:
            text = self._feedback_text(request)
            fb = "\n\n" + self.feedback_template.format(feedback=text) if text else ""
        demo = self._demonstration(group.completions[j])  # type: ignore[union-attr]
        if not demo:
            return None
        text = self.template.format(demonstration=demo, feedback=fb)
        if fb and "{feedback}" not in self.template:
            text = text.rstrip() + fb
        return text.strip() or None


def build_hint_provider(spec: Any, key: str = "hints") -> HintProvider:
    """A hint provider on the request contract from a name (``"template"``), ``{"name": ..., **kwargs}`` or an
    object (a provider, or an older-shape provider or callable, adapted once here: :func:`as_hint_provider`)."""
    if isinstance(spec, str | Mapping):
        from composer_plugins.core.config import build_component

        spec = build_component("hints", spec, key=key)
    return as_hint_provider(spec)


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
