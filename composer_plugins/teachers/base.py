"""The teacher contract: what a teacher is given, what it returns, and how its calls fail.

A teacher answers *one student step*: it is shown the chat messages up to that step
(OpenAI message shape, thinking hidden) and returns the action it would have taken
(:class:`TeacherResponse`: action text and assistant message, token usage, cost, latency).

Teachers do a single attempt per :meth:`Teacher.complete` call; retries, the budget and
the cache live in :class:`~composer_plugins.teachers.engine.ReplayEngine`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from composer_plugins.core.errors import ComposerPluginsError

Message = dict[str, Any]

#: Per-message token overhead added to prompt estimates (role markers, separators).
MESSAGE_OVERHEAD_TOKENS = 8
#: Fixed per-request token overhead added to prompt estimates (BOS, generation prompt).
REQUEST_OVERHEAD_TOKENS = 16


class TeacherError(ComposerPluginsError):
    """A teacher is misconfigured (bad argument, missing key variable, unloadable model)."""


class TeacherCallError(ComposerPluginsError):
    """One call to a teacher failed.

    Attributes:
        retryable: ``True`` for 429, 5xx, timeouts, dropped connections and malformed bodies.
        status: the HTTP status, if a response arrived.
        retry_after: seconds the server asked to wait (``Retry-After``), if any.
        billed: ``"no"`` when the provider cannot have charged for the call (it answered
            with an error status before doing work), ``"maybe"`` when it may have (timeout
            or dropped connection after sending, unreadable 200 body).
        kind: a short machine-readable label (``http_429``, ``timeout``, ``malformed`` ...).
    """

    def __init__(
        self,
        message: str,
        *,
        retryable: bool,
        status: int | None = None,
        retry_after: float | None = None,
        billed: Literal["no", "maybe"] = "no",
        kind: str = "error",
    ) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.status = status
        self.retry_after = retry_after
        self.billed = billed
        self.kind = kind


@dataclass
class TeacherResponse:
    """What a teacher returned for one state.

    Attributes:
        text: the action as flat text (content, then tool calls one JSON object per line).
        message: the assistant message (``{"role": "assistant", "content": ..., "tool_calls": [...]}``).
        prompt_tokens, completion_tokens: token usage (as reported by the provider when it does).
        cost_usd: what the call cost, from usage × the teacher's per-token prices.
        latency_s: wall time of the successful attempt.
        model: the model that answered.
        teacher: the teacher's id in the run.
        finish_reason: the provider's finish reason, if any.
        cached: ``True`` when served from the replay cache (``cost_usd`` is then what it cost originally).
    """

    text: str
    message: Message
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    latency_s: float = 0.0
    model: str = ""
    teacher: str = ""
    finish_reason: str | None = None
    cached: bool = False

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (what the cache stores, minus ``cached``)."""
        return {
            "text": self.text,
            "message": self.message,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cost_usd": self.cost_usd,
            "latency_s": self.latency_s,
            "model": self.model,
            "teacher": self.teacher,
            "finish_reason": self.finish_reason,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], cached: bool = False) -> TeacherResponse:
        """Inverse of :meth:`to_dict`."""
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data and k != "cached"}
        return cls(**known, cached=cached)


@dataclass
class TeacherInfo:
    """A light description of a teacher (for reports and pair provenance)."""

    id: str
    kind: str
    model: str
    params: dict[str, Any] = field(default_factory=dict)


def render_action(message: Mapping[str, Any] | str | None) -> str:
    """Flat text of an assistant action: its content, then each tool call as a JSON line.

    Thinking (``thinking`` / ``reasoning_content``) is not part of the rendered action.
    """
    if message is None:
        return ""
    if isinstance(message, str):
        return message
    parts: list[str] = []
    content = message.get("content")
    if isinstance(content, str):
        if content:
            parts.append(content)
    elif isinstance(content, list):  # content parts
        parts.extend(str(p.get("text", "")) for p in content if isinstance(p, Mapping) and p.get("text"))
    for call in message.get("tool_calls") or ():
        fn = call.get("function", call) if isinstance(call, Mapping) else {}
        args = fn.get("arguments", "")
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        parts.append(json.dumps({"tool": fn.get("name", ""), "arguments": args}, ensure_ascii=False))
    return "\n".join(parts)


def render_messages(messages: Sequence[Mapping[str, Any]]) -> str:
    """Flat text of a conversation: ``<|role|>`` headers followed by each message's rendered content.

    Used for the ``prompt`` field of pairs and by teachers without a chat template.
    """
    chunks = []
    for m in messages:
        role = str(m.get("role", "user"))
        body = render_action(m) if role == "assistant" else _content_text(m.get("content"))
        if role == "tool" and m.get("tool_call_id"):
            role = f"tool:{m['tool_call_id']}"
        chunks.append(f"<|{role}|>\n{body}")
    return "\n".join(chunks)


def prompt_text(messages: Sequence[Mapping[str, Any]]) -> str:
    """The flat prompt of a conversation, as a text-completion policy would be fed it.

    A conversation that is a single user message is that message's text, unchanged (what a
    policy rolled out on raw prompts saw). Anything longer is :func:`render_messages` followed
    by an ``<|assistant|>`` header (consumers with a chat template should use the messages).
    """
    if len(messages) == 1 and messages[0].get("role") == "user":
        return _content_text(messages[0].get("content"))
    return render_messages(messages) + "\n<|assistant|>\n"


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping) and "text" in p)
    return str(content)


def estimate_prompt_tokens(messages: Sequence[Mapping[str, Any]], extra: Any = None) -> int:
    """An upper bound on the prompt tokens of ``messages`` for byte-level BPE tokenizers.

    A byte-level BPE token covers at least one UTF-8 byte, so the number of bytes of the
    serialized messages (plus per-message and per-request overheads for role markers) bounds
    the real count from above. ``extra`` (e.g. a tool schema sent along) is counted too.
    """
    total = REQUEST_OVERHEAD_TOKENS
    for m in messages:
        total += MESSAGE_OVERHEAD_TOKENS
        for k, v in m.items():
            if k == "role":
                continue
            if isinstance(v, str):
                total += len(v.encode("utf-8"))
            elif v is not None:
                total += len(json.dumps(v, ensure_ascii=False).encode("utf-8"))
    if extra:
        total += len(json.dumps(extra, ensure_ascii=False).encode("utf-8"))
    return total


class Teacher:
    """Base class of teacher providers.

    Subclasses set :attr:`kind`, implement :meth:`complete` (one attempt) and, when they
    cost money, set per-token prices so :meth:`max_cost` can reserve the worst case before
    a call. :meth:`cache_params` lists everything besides the messages that changes the
    answer; it is part of the cache key.
    """

    #: Registry name of the provider (``openai``, ``hf``, ``oracle`` ...).
    kind: ClassVar[str] = "teacher"
    #: False for teachers whose answers are instantaneous and free (no point caching them).
    cacheable: ClassVar[bool] = True

    def __init__(
        self,
        *,
        id: str | None = None,
        model: str = "",
        max_tokens: int = 512,
        max_concurrency: int = 8,
        prompt_usd_per_token: float = 0.0,
        completion_usd_per_token: float = 0.0,
    ) -> None:
        if max_concurrency < 1:
            raise TeacherError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if max_tokens < 1:
            raise TeacherError(f"max_tokens must be >= 1, got {max_tokens}")
        if prompt_usd_per_token < 0 or completion_usd_per_token < 0:
            raise TeacherError("per-token prices must be >= 0")
        self.model = model
        self.id = id or model or self.kind
        self.max_tokens = int(max_tokens)
        self.max_concurrency = int(max_concurrency)
        self.prompt_usd_per_token = float(prompt_usd_per_token)
        self.completion_usd_per_token = float(completion_usd_per_token)

    # -- accounting ------------------------------------------------------------------
    def cost(self, prompt_tokens: int, completion_tokens: int) -> float:
        """Dollar cost of a call with this usage."""
        return prompt_tokens * self.prompt_usd_per_token + completion_tokens * self.completion_usd_per_token

    def max_cost(self, messages: Sequence[Mapping[str, Any]]) -> float:
        """Worst-case cost of one call on ``messages``: prompt upper bound × price + max_tokens × price."""
        if not self.prompt_usd_per_token and not self.completion_usd_per_token:
            return 0.0
        return self.cost(estimate_prompt_tokens(messages, self._prompt_extra()), self.max_tokens)

    def _prompt_extra(self) -> Any:
        return None

    # -- identity ----------------------------------------------------------------------
    def cache_params(self) -> dict[str, Any]:
        """Everything besides the messages that changes the answer (sampling params, tools ...)."""
        return {"max_tokens": self.max_tokens}

    def info(self) -> TeacherInfo:
        """A :class:`TeacherInfo` for reports."""
        return TeacherInfo(self.id, self.kind, self.model, self.cache_params())

    def check(self) -> None:
        """Fail fast on misconfiguration (missing key variable, missing model) before a run starts."""

    # -- calling -------------------------------------------------------------------------
    async def complete(
        self, messages: Sequence[Mapping[str, Any]], *, metadata: Mapping[str, Any] | None = None
    ) -> TeacherResponse:
        """One attempt at answering ``messages``. Raises :class:`TeacherCallError` on failure."""
        raise NotImplementedError(f"{type(self).__name__} must implement complete()")

    async def aclose(self) -> None:
        """Release connections or models (called by the engine when a run ends)."""

    def act(
        self, messages: Sequence[Mapping[str, Any]], *, metadata: Mapping[str, Any] | None = None
    ) -> TeacherResponse:
        """Synchronous convenience wrapper around :meth:`complete` (no retries, no cache)."""

        async def _go() -> TeacherResponse:
            try:
                return await self.complete(messages, metadata=metadata)
            finally:
                await self.aclose()

        return asyncio.run(_go())

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id!r}, model={self.model!r})"


def assistant_message(content: str | None, tool_calls: Sequence[Mapping[str, Any]] | None = None) -> Message:
    """An OpenAI-shaped assistant message."""
    msg: Message = {"role": "assistant", "content": content}
    if tool_calls:
        msg["tool_calls"] = [dict(c) for c in tool_calls]
    return msg
