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

Providers that want the rollout group accept ``groups=`` in ``hints(...)`` (one
:class:`SiblingGroup` or ``None`` per row) and/or ``group=`` in ``hint(...)``; callers pass them
only to providers whose signature takes them (:func:`provider_hints`), so a provider written
against the four-argument contract keeps working unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
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
    "LLMTeacherHintProvider",
    "RawErrorHintProvider",
    "SiblingGroup",
    "TemplateHintProvider",
    "accepts_keyword",
    "build_hint_provider",
    "build_teacher_context",
    "hint_request_messages",
    "hints_all_rows",
    "provider_hints",
    "sibling_groups",
    "wants_groups",
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


def sibling_groups(completions: Sequence[Any], rewards: Sequence[float], group_size: int,
                   success_threshold: float = 1.0) -> list[SiblingGroup]:  # fmt: skip
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


@functools.lru_cache(maxsize=512)
def _takes_keyword(fn: Any, name: str) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    p = params.get(name)
    if p is not None and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
        return True
    return any(q.kind is inspect.Parameter.VAR_KEYWORD for q in params.values())


def accepts_keyword(fn: Any, name: str) -> bool:
    """Whether the callable ``fn`` takes the keyword ``name`` (by name, or through ``**kwargs``).

    Looked up once per function (a bound method counts as its function, a callable object as
    its class's ``__call__``), so the per-row calls of a rollout pay nothing.
    """
    target = getattr(fn, "__func__", fn)
    if not inspect.isfunction(target):
        call = vars(type(target)).get("__call__")  # a callable object: its class's __call__
        target = call if inspect.isfunction(call) else target
    try:
        return _takes_keyword(target, name)
    except TypeError:  # an unhashable callable: inspect it without the cache
        return bool(_takes_keyword.__wrapped__(target, name))


def wants_groups(provider: Any) -> bool:
    """Whether ``provider`` reads the rollout group (its ``hints`` takes ``groups=`` or its ``hint`` ``group=``).

    A caller that must do extra work to build the groups (gather them across processes) asks first.
    """
    hints_fn = getattr(provider, "hints", None)
    if callable(hints_fn) and getattr(hints_fn, "__func__", None) is not HintProvider.hints:
        return accepts_keyword(hints_fn, "groups")  # its own batch method decides
    fn = getattr(provider, "hint", None) or provider
    return callable(fn) and accepts_keyword(fn, "group")


def provider_hints(
    provider: Any,
    feedbacks: Sequence[Any],
    prompts: Sequence[Any] | None = None,
    completions: Sequence[Any] | None = None,
    tasks: Sequence[Mapping[str, Any]] | None = None,
    groups: Sequence[SiblingGroup | None] | None = None,
) -> list[str | None]:
    """Hints of any provider: a :class:`HintProvider`, an object with ``hints``/``hint``, or a plain callable.

    ``groups`` (one :class:`SiblingGroup` or ``None`` per row) reaches the provider only if its
    ``hints`` takes ``groups=`` (or its ``hint`` takes ``group=``); providers written without
    them are called exactly as before.
    """
    n = len(feedbacks)
    if groups is not None and len(groups) != n:
        raise ValueError(f"{len(groups)} groups for {n} rows")
    hints_fn = getattr(provider, "hints", None)
    if callable(hints_fn):
        if groups is not None and accepts_keyword(hints_fn, "groups"):
            return list(hints_fn(feedbacks, prompts, completions, tasks, groups=groups))
        return list(hints_fn(feedbacks, prompts, completions, tasks))
    fn = getattr(provider, "hint", None) or provider
    with_group = groups is not None and accepts_keyword(fn, "group")
    out: list[str | None] = []
    for i in range(n):
        kw: dict[str, Any] = {
            "prompt": prompts[i] if prompts else None,
            "completion": completions[i] if completions else None,
            "task": tasks[i] if tasks else None,
        }
        if with_group:
            kw["group"] = groups[i]  # type: ignore[index]
        out.append(fn(feedbacks[i], **kw))
    return out


class HintProvider:
    """Base class: ``hint(feedback, prompt=..., completion=..., task=...) -> str | None``.

    ``None`` means "no hint" (the completion was correct, or nothing useful can be said).
    A subclass that needs the rollout group adds ``group: SiblingGroup | None = None`` to
    ``hint`` (the batch :meth:`hints` then passes each row's group to it).
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
        *,
        groups: Sequence[SiblingGroup | None] | None = None,
    ) -> list[str | None]:
        """Hints for a batch (providers that call models do this concurrently).

        ``groups`` reaches :meth:`hint` as ``group=`` when the subclass's ``hint`` takes it.
        """
        return provider_hints(_HintOnly(self.hint), feedbacks, prompts, completions, tasks, groups)

    def __call__(self, feedback: Feedback, **kw: Any) -> str | None:
        return self.hint(feedback, **kw)


class _HintOnly:
    """Expose only a ``hint`` callable, so :func:`provider_hints` loops over rows with it."""

    def __init__(self, hint: Any) -> None:
        self.hint = hint


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
        self,
        feedback: Feedback,
        *,
        prompt: Any = None,
        completion: Any = None,
        task: Mapping[str, Any] | None = None,
        group: SiblingGroup | None = None,
    ) -> str | None:
        for p in self.providers:
            h = provider_hints(p, [feedback], [prompt], [completion], [task], None if group is None else [group])[0]
            if h:
                return h
        return None


#: SDPO's reprompting defaults (Hübotter et al. 2026), worded for the ``Hint: ...`` block of a teacher context.
#: ``{feedback}`` is empty, or the rendered ``feedback_template`` after a blank line.
DEMONSTRATION_TEMPLATE = "Correct solution:\n{demonstration}{feedback}\n\nCorrectly solve the original question."
FEEDBACK_TEMPLATE = "The following is feedback from your unsuccessful earlier attempt:\n{feedback}"
_PICKS = ("first", "shortest", "random")
_FALLBACKS = ("feedback", "none")
#: The rows a hint provider is asked about: ``failed`` (the default) or ``all`` (a provider whose ``rows``
#: attribute is ``"all"``, e.g. SDPO's demonstrations, also hints rows that succeeded).
_ROWS = ("failed", "all")


def hints_all_rows(provider: Any) -> bool:
    """Whether ``provider`` asks for every rollout row, successful ones too (its ``rows`` is ``"all"``)."""
    return getattr(provider, "rows", "failed") == "all"


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
        rows: ``failed`` (a hint for failed rows only; GRPO covers the rest, as SRPO routes them) or
            ``all`` (SDPO's rule: every row with a successful sibling other than itself, successful
            rows too; the trainer then asks about every row).
    """

    name = "demonstration"

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

    def _feedback_text(self, feedback: Feedback, prompt: Any, completion: Any, task: Any) -> str | None:
        return provider_hints(self.feedback_provider, [feedback], [prompt], [completion], [task])[0]

    def hint(
        self,
        feedback: Feedback,
        *,
        prompt: Any = None,
        completion: Any = None,
        task: Mapping[str, Any] | None = None,
        group: SiblingGroup | None = None,
    ) -> str | None:
        succeeded = (feedback is not None and feedback.ok) or (
            group is not None and group.reward >= self._threshold(group)
        )
        if feedback is not None and feedback.kind in ("unscorable", "sandbox_error"):
            return None
        if succeeded and self.rows == "failed":
            return None  # the row itself succeeded: nothing to correct
        j = self.pick_sibling(group) if group is not None else None
        if j is None and succeeded:
            return None  # rows: all distils a successful row only from another success
        if j is None:
            if self.fallback == "none" or feedback is None:
                return None
            return self._feedback_text(feedback, prompt, completion, task)
        fb = ""
        if self.include_feedback and feedback is not None:
            text = self._feedback_text(feedback, prompt, completion, task)
            fb = "\n\n" + self.feedback_template.format(feedback=text) if text else ""
        demo = self._demonstration(group.completions[j])  # type: ignore[union-attr]
        if not demo:
            return None
        text = self.template.format(demonstration=demo, feedback=fb)
        if fb and "{feedback}" not in self.template:
            text = text.rstrip() + fb
        return text.strip() or None


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
