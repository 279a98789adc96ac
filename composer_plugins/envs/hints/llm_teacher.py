"""The ``llm_teacher`` provider: a teacher model writes the hint from the task, the attempt and the feedback."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from composer_plugins.envs.base import Feedback, prompt_text
from composer_plugins.envs.hints.contract import HintProvider, HintRequest, build_hint_provider
from composer_plugins.envs.hints.feedback import _short

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

    ``teacher``, ``teacher_kwargs``, ``fallback`` (``None``: no hint), ``max_concurrency`` and ``reveal_answer``:
    docs/envs.md, "Hints"; ``max_chars`` truncates hints.
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
        feedback = request.failure
        if feedback is None:
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
        async def all_() -> list[str | None]:
            sem = asyncio.Semaphore(self.max_concurrency)

            async def one(r: HintRequest) -> str | None:
                async with sem:
                    return await self.ahint(r)

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
