"""The teacher contract: what a teacher is given, what it returns, and how its calls fail.

A teacher makes one attempt per :meth:`Teacher.complete` call; retries, the budget and the cache live in
:class:`~composer_plugins.teachers.engine.ReplayEngine` (docs/plugins.md, "Writing a teacher provider").
"""

from __future__ import annotations

import asyncio
import json
import math
import operator
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from composer_plugins.core.errors import ComposerPluginsError

Message = dict[str, Any]

#: Per-message token overhead added to prompt estimates (role markers, separators).
MESSAGE_OVERHEAD_TOKENS = 8
#: Fixed per-request token overhead added to prompt estimates (BOS, generation prompt).
REQUEST_OVERHEAD_TOKENS = 16


class TeacherError(ComposerPluginsError):
    """A teacher is misconfigured (bad argument, missing key variable, unloadable model).

    ``field``: the teacher argument at fault, when one is (config loaders point at that key's line).
    """

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


#: Key fragments at least this long are scrubbed from error texts (shorter ones carry too little to matter).
SCRUB_MIN_CHARS = 8

_BEARER = re.compile(r"(?i)\b(bearer\s+)[^\s\"'\\,;]+")

#: Prefixes of common provider keys (OpenAI, Anthropic, Hugging Face, Groq, GitHub, GitLab, xAI,
#: Replicate, NVIDIA, Perplexity, Slack, AWS, Google ...).
_KEY_PREFIXES = tuple(
    "sk- sk_ hf_ gsk_ ghp_ gho_ ghu_ ghs_ github_pat_ glpat- xai- r8_ "
    "nvapi- pplx- xoxb- xoxp- AKIA AIza fw_ tgp_ csk- or-".split()
)
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def scrub_secret(text: str, secret: str | None, min_chars: int = SCRUB_MIN_CHARS) -> str:
    """``text`` with every ``Bearer <token>`` and every run of ``min_chars``+ characters of ``secret`` (a key cut
    anywhere, or whole) replaced by ``****``; a shorter key is masked whole. See docs/replay.md, "API keys"."""
    if not text:
        return text
    text = _BEARER.sub(r"\1****", text)
    if not secret:
        return text
    n = min(min_chars, len(secret))
    grams = {secret[i : i + n] for i in range(len(secret) - n + 1)}
    spans: list[list[int]] = []
    for i in range(len(text) - n + 1):
        if text[i : i + n] in grams:
            if spans and i <= spans[-1][1]:
                spans[-1][1] = i + n
            else:
                spans.append([i, i + n])
    out, last = [], 0
    for a, b in spans:
        out += [text[last:a], "****"]
        last = b
    return "".join([*out, text[last:]])


def looks_like_key(value: str) -> bool:
    """Whether ``value`` looks like a credential rather than an environment variable's name: not a plain name, a
    known key prefix (``sk-``, ``hf_`` ...) plus 16+ characters, or a 16+ character part (between ``_``) mixing
    two of digits, lower and upper case (``OPENROUTER_API_KEY`` is a name; ``hf_AbC...`` is a key)."""
    if not _ENV_NAME.fullmatch(value):
        return True
    if any(value.startswith(p) and len(value) >= len(p) + 16 for p in _KEY_PREFIXES):
        return True
    kinds = (str.isdigit, str.islower, str.isupper)
    return any(len(part) >= 16 and sum(any(map(k, part)) for k in kinds) >= 2 for part in value.split("_"))


def _shown(value: Any) -> str:
    """``repr(value)`` for a short harmless value; a description otherwise (never echo a pasted key)."""
    r = repr(value)
    if isinstance(value, str) and (len(value) > 24 or (looks_like_key(value) and len(value) > 12)):
        return f"a {len(value)}-character string (not shown)"
    return r if len(r) <= 40 else f"a {type(value).__name__} (not shown)"


def _number_fix(field: str, value: Any, integer: bool, example: str) -> str:
    if isinstance(value, str):
        v = value.strip()
        try:
            num = float(v)
        except ValueError:
            num = None
        if num is not None and math.isfinite(num):
            if not integer or num.is_integer():
                plain = int(num) if integer else v
                return f"It is quoted, so YAML reads it as text. HINT: write {field}: {plain} (no quotes)"
    kind = "a whole number" if integer else "a number"
    return f"HINT: write {kind}, e.g. {field}: {example}"


def check_number(
    value: Any,
    field: str,
    who: str,
    *,
    integer: bool = False,
    minimum: float | None = None,
    above: float | None = None,
    maximum: float | None = None,
    example: str = "1",
) -> Any:
    """``value`` if it is a number of the right kind and range; else a :class:`TeacherError` naming ``field``.

    ``minimum`` is inclusive, ``above`` exclusive. Booleans, strings (YAML reads ``2e-6`` as
    text) and NaN/inf are refused with the fix.
    """
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or (not integer and not math.isfinite(value)):
        what = "a whole number" if integer else "a number"
        raise TeacherError(
            f"{who}: {field} must be {what}, got {_shown(value)}. {_number_fix(field, value, integer, example)}",
            field=field,
        )
    for op, bound, ok in ((">=", minimum, operator.ge), (">", above, operator.gt), ("<=", maximum, operator.le)):
        if bound is not None and not ok(value, bound):
            raise TeacherError(
                f"{who}: {field} must be {op} {bound:g}, got {value!r}. HINT: e.g. {field}: {example}", field=field
            )
    return value


def check_sampling(who: str, temperature: Any, top_p: Any, seed: Any, *, required: bool = False) -> tuple[Any, ...]:
    """``(temperature, top_p, seed)`` as given, once checked: ``temperature >= 0``, ``top_p`` in (0, 1], a whole
    ``seed``; None keeps the provider's default unless ``required``. Else a :class:`TeacherError` naming the field."""
    if temperature is not None or required:
        check_number(temperature, "temperature", who, minimum=0, example="0")
    if top_p is not None or required:
        check_number(top_p, "top_p", who, above=0, maximum=1, example="0.95")
    if seed is not None or required:
        check_number(seed, "seed", who, integer=True, example="0")
    return temperature, top_p, seed


class TeacherCallError(ComposerPluginsError):
    """One call to a teacher failed.

    ``billed``: ``"no"`` when the provider cannot have charged for the call (an error status before any work),
    ``"maybe"`` when it may have (timeout or dropped connection after sending, unreadable 200 body). ``kind``: a
    short label (``http_429``, ``timeout``, ``malformed`` ...). Which failures are retryable: docs/replay.md.
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


try:  # orjson is optional: it reads and writes JSON several times faster; the text is plain JSON either way
    import orjson

    def json_bytes(obj: Any) -> bytes:
        """``obj`` as compact UTF-8 JSON (orjson when installed)."""
        return orjson.dumps(obj)

    json_loads: Callable[[bytes | str], Any] = orjson.loads
except ImportError:  # pragma: no cover - depends on the environment

    def json_bytes(obj: Any) -> bytes:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")

    json_loads = json.loads


@dataclass
class CallCounts:
    """The counters every teacher kind keeps: calls sent, answers served from a cache, failed rows, spend."""

    calls: int = 0
    cache_hits: int = 0
    failures: int = 0
    spent_usd: float = 0.0


@dataclass
class TeacherResponse:
    """What a teacher returned for one state.

    ``text`` is the action flattened (content, then one JSON tool call per line), ``message`` the assistant
    message; ``cost_usd`` is the usage × the teacher's prices (for a ``cached`` answer, what it cost originally).
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
        return {k: v for k, v in vars(self).items() if k != "cached"}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], cached: bool = False) -> TeacherResponse:
        """Inverse of :meth:`to_dict`."""
        known = {k: data[k] for k in cls.__dataclass_fields__ if k in data and k != "cached"}
        return cls(**known, cached=cached)


def estimate_prompt_tokens(messages: Sequence[Mapping[str, Any]], extra: Any = None) -> int:
    """An upper bound on the prompt tokens of ``messages`` (and ``extra``, e.g. tool schemas) for byte-level BPE
    tokenizers: their UTF-8 bytes plus overheads (docs/replay.md, "The replay engine", Budget)."""
    total = REQUEST_OVERHEAD_TOKENS + MESSAGE_OVERHEAD_TOKENS * len(messages)
    for m in messages:
        for k, v in m.items():
            if k != "role" and v is not None:
                total += len((v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)).encode("utf-8"))
    if extra:
        total += len(json.dumps(extra, ensure_ascii=False).encode("utf-8"))
    return total


class Teacher:
    """Base class of teacher providers.

    What a subclass sets and implements: docs/plugins.md, "Writing a teacher provider".
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
        self.model = model
        self.id = id or model or self.kind
        who = f"{self.kind} teacher {self.id!r}"
        check_number(max_concurrency, "max_concurrency", who, integer=True, minimum=1, example="8")
        check_number(max_tokens, "max_tokens", who, integer=True, minimum=1, example="512")
        price = "1.5e-7 (dollars per token)"
        check_number(prompt_usd_per_token, "prompt_usd_per_token", who, minimum=0, example=price)
        check_number(completion_usd_per_token, "completion_usd_per_token", who, minimum=0, example=price)
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

    def response(
        self,
        text: str,
        prompt_tokens: int = 0,
        completion_tokens: int = 0,
        *,
        message: Message | None = None,
        latency_s: float = 0.0,
        model: str | None = None,
        finish_reason: str | None = None,
    ) -> TeacherResponse:
        """This teacher's answer ``text`` (``message``: default a plain assistant message of it), its usage priced
        by :meth:`cost`, stamped with the teacher's id and the model that answered (default this teacher's)."""
        return TeacherResponse(
            text,
            assistant_message(text) if message is None else message,
            prompt_tokens,
            completion_tokens,
            self.cost(prompt_tokens, completion_tokens),
            latency_s,
            self.model if model is None else model,
            self.id,
            finish_reason,
        )

    # -- identity ----------------------------------------------------------------------
    def cache_params(self) -> dict[str, Any]:
        """Everything besides the messages that changes the answer (sampling params, tools ...)."""
        return {"max_tokens": self.max_tokens}

    def check(self) -> None:
        """Fail fast on misconfiguration (missing key variable, missing model) before a run starts."""

    def scrub(self, text: str) -> str:
        """``text`` without any secret this teacher holds (applied to every failure message it produces)."""
        return _BEARER.sub(r"\1****", text) if text else text

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
