"""The ``openai`` teacher: any OpenAI-compatible chat-completions endpoint over async HTTP.

One transport, ``aiohttp``, with one mapping of its failures to :class:`TeacherCallError`; why aiohttp, and how
the key is held and scrubbed: docs/replay.md, "Teachers" and "API keys".
"""

from __future__ import annotations

import contextvars
import email.utils
import functools
import os
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from composer_plugins.chat.render import render_action
from composer_plugins.core.config import Secret
from composer_plugins.teachers.base import (
    Teacher,
    TeacherCallError,
    TeacherError,
    TeacherResponse,
    assistant_message,
    check_number,
    check_sampling,
    estimate_prompt_tokens,
    json_bytes,
    json_loads,
    looks_like_key,
    scrub_secret,
)

RETRYABLE_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504, 520, 522, 524, 529})

#: How much of an error body goes into an error message (after the key has been scrubbed from it).
ERROR_BODY_CHARS = 300
MALFORMED_BODY_CHARS = 200


@dataclass(slots=True)
class _Sent:
    """Set by the HTTP client once request bytes may have left this process."""

    sent: bool = False


#: The attempt in progress in this task (aiohttp runs the connector in the caller's task).
_ATTEMPT: contextvars.ContextVar[_Sent | None] = contextvars.ContextVar("openai_teacher_attempt", default=None)


@functools.cache
def _connector_class() -> Any:
    """A ``TCPConnector`` that marks the current attempt as sent once it holds a connection.

    Everything before that (URL checks, DNS, connecting, TLS, waiting for a pool slot) sends
    nothing; from there on the request is written. Cheaper than aiohttp's tracing, which costs
    tens of microseconds per request.
    """
    import aiohttp

    class _MarkingConnector(aiohttp.TCPConnector):
        async def connect(self, *args: Any, **kwargs: Any) -> Any:
            conn = await super().connect(*args, **kwargs)
            flag = _ATTEMPT.get()
            if flag is not None:
                flag.sent = True
            return conn

    return _MarkingConnector


def check_base_url(base_url: object, who: str) -> str:
    """``base_url`` without a trailing ``/`` if it is an ``http(s)://host[:port][/path]`` URL; else a
    :class:`TeacherError` naming ``base_url`` and the fix (never echoing a URL that may hold a key)."""

    def bad(problem: str) -> TeacherError:
        return TeacherError(f"{who}: base_url {problem}", field="base_url")

    example = "e.g. base_url: https://api.openai.com/v1 or http://127.0.0.1:8000/v1"
    if not isinstance(base_url, str) or not base_url.strip():
        raise bad(f"must be a URL ({example}).")
    url = base_url.strip()
    try:
        parts = urllib.parse.urlsplit(url)
        host, _port = parts.hostname, parts.port
    except ValueError as e:
        shown = "" if "@" in url or "?" in url else f"{url!r} "
        raise bad(f"{shown}is not a valid URL ({e}). HINT: {example}") from None
    if parts.username is not None or parts.password is not None or parts.query or parts.fragment:
        raise bad(
            "must not carry credentials (user:password@), a query (?...) or a fragment (not shown: it may hold a "
            "key). HINT: put the key in an environment variable and name it in api_key_env; base_url is only the "
            "endpoint root, e.g. https://openrouter.ai/api/v1"
        )
    if "://" not in url or parts.scheme.lower() not in ("http", "https"):
        fix = (
            f"write base_url: http://{url} (https:// for a remote provider)"
            if "://" not in url
            else "use http:// (a local server) or https:// (a remote provider)"
        )
        raise bad(f"{url!r} has no http:// or https:// scheme, so no request can be sent to it. HINT: {fix}")
    if not host:
        raise bad(f"{url!r} has no host. HINT: {example}")
    if any(c.isspace() for c in url):
        raise bad(f"{url!r} contains whitespace. HINT: {example}")
    return url.rstrip("/")


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or an HTTP date); ``None`` if absent/bad."""
    value = (value or "").strip()
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        dt = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    return max(0.0, dt.timestamp() - (now if now is not None else time.time()))


class OpenAITeacher(Teacher):
    """A teacher served by an OpenAI-compatible chat-completions endpoint (async HTTP).

    ``api_key_env`` names the variable holding the key (``None``: send no key); ``id`` defaults to ``model``;
    ``timeout_s`` bounds one attempt; ``http_client`` only accepts ``"aiohttp"`` (kept so old configs load). The
    other arguments: docs/replay.md, "Teachers" and its example config.
    """

    kind = "openai"

    def __init__(
        self,
        model: str,
        base_url: str = "https://api.openai.com/v1",
        api_key_env: str | None = "OPENAI_API_KEY",
        *,
        id: str | None = None,
        prompt_usd_per_token: float = 0.0,
        completion_usd_per_token: float = 0.0,
        max_tokens: int = 512,
        temperature: float | None = 0.0,
        top_p: float | None = None,
        seed: int | None = None,
        stop: str | list[str] | None = None,
        tools: list[dict[str, Any]] | None = None,
        extra_body: Mapping[str, Any] | None = None,
        max_tokens_param: str = "max_tokens",
        timeout_s: float = 60.0,
        max_concurrency: int = 8,
        http_client: Literal["aiohttp"] = "aiohttp",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(
            id=id,
            model=model,
            max_tokens=max_tokens,
            max_concurrency=max_concurrency,
            prompt_usd_per_token=prompt_usd_per_token,
            completion_usd_per_token=completion_usd_per_token,
        )
        who = f"openai teacher {self.id!r}"
        if not model:
            raise TeacherError(
                "openai teacher: `model` is required (the model name sent to the endpoint)", field="model"
            )
        if http_client != "aiohttp":
            raise TeacherError(
                f"{who}: http_client must be 'aiohttp' (the one transport), got {http_client!r}. The httpx "
                "transport was removed: on benchmarks/bench_replay.py it made 35x fewer calls/s at 64 in flight. "
                "HINT: delete the http_client line",
                field="http_client",
            )
        if api_key_env is not None and (not isinstance(api_key_env, str) or looks_like_key(api_key_env)):
            # never echo it: what was pasted here is often the key itself
            raise TeacherError(
                f"{who}: api_key_env must be the NAME of an environment variable (e.g. OPENROUTER_API_KEY); "
                "the value given is not a variable name or looks like a key itself (not shown). "
                "HINT: export the key in a variable (export OPENROUTER_API_KEY=...) and put only the "
                "variable's name here; if a real key was pasted into a file, rotate it",
                field="api_key_env",
            )
        if any(h.lower() in ("authorization", "api-key", "x-api-key", "proxy-authorization") for h in headers or {}):
            raise TeacherError(
                f"{who}: do not pass the key in headers; set api_key_env to the variable name", field="headers"
            )
        check_number(timeout_s, "timeout_s", who, above=0, example="60 (seconds per attempt)")
        self.temperature, self.top_p, self.seed = check_sampling(who, temperature, top_p, seed)
        if not isinstance(max_tokens_param, str) or not max_tokens_param:
            raise TeacherError(
                f"{who}: max_tokens_param must be a field name such as max_tokens or max_completion_tokens",
                field="max_tokens_param",
            )
        self.base_url = check_base_url(base_url, who)
        self.url = self.base_url + "/chat/completions"
        self.api_key_env = api_key_env
        self.stop = stop
        self.tools = tools
        self.extra_body = dict(extra_body or {})
        self.max_tokens_param = max_tokens_param
        self.timeout_s = float(timeout_s)
        self.http_client = http_client
        self.extra_headers = dict(headers or {})
        self._api_key: Secret | None = None
        self._session: Any = None
        self._session_loop: Any = None

    # -- identity ------------------------------------------------------------------------
    def _sampling(self) -> dict[str, Any]:
        """The sampling fields that are set (sent with every request, part of the cache key)."""
        return {k: v for k in ("temperature", "top_p", "seed", "stop", "tools") if (v := getattr(self, k)) is not None}

    def cache_params(self) -> dict[str, Any]:
        p: dict[str, Any] = {"max_tokens": self.max_tokens, **self._sampling()}
        if self.extra_body:
            p["extra_body"] = self.extra_body
        return p

    def _prompt_extra(self) -> Any:
        return self.tools

    def __repr__(self) -> str:
        return (
            f"OpenAITeacher(id={self.id!r}, model={self.model!r}, base_url={self.base_url!r}, "
            f"api_key_env={self.api_key_env!r}, http_client={self.http_client!r})"
        )

    # -- key handling --------------------------------------------------------------------
    def _key(self) -> Secret | None:
        if self.api_key_env is None:
            return None
        if self._api_key is None:
            value = os.environ.get(self.api_key_env)
            if not value:
                raise TeacherError(
                    f"openai teacher {self.id!r}: environment variable {self.api_key_env} is not set. "
                    f"HINT: export {self.api_key_env}=... (or set api_key_env: null for an endpoint without auth)"
                )
            self._api_key = Secret(value, self.api_key_env)
        return self._api_key

    def check(self) -> None:
        self._key()

    def scrub(self, text: str) -> str:
        key = self._api_key
        return scrub_secret(text, key.reveal() if key is not None else None)

    def _snippet(self, body: bytes, limit: int) -> str:
        """The first ``limit`` characters of ``body``, scrubbed *before* the cut (a key crossing it is seen whole)."""
        key = self._api_key
        extra = 2 * len(key.reveal()) if key is not None else 0
        text = body[: 4 * limit + extra + 64].decode("utf-8", "replace")
        return self.scrub(text)[:limit]

    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json", **self.extra_headers}
        key = self._key()
        if key is not None:
            h["Authorization"] = "Bearer " + key.reveal()
        return h

    # -- request / response --------------------------------------------------------------
    def build_request(self, messages: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """The JSON body sent for ``messages``."""
        head = {"model": self.model, "messages": list(messages), self.max_tokens_param: self.max_tokens}
        return {**head, **self._sampling(), **self.extra_body}

    def _parse(self, raw: bytes, messages: Sequence[Mapping[str, Any]], latency: float) -> TeacherResponse:
        try:
            data = json_loads(raw)
            choice = data["choices"][0]
            msg = choice["message"]
            content = msg.get("content")
            tool_calls = msg.get("tool_calls") or None
            if content is not None and not isinstance(content, str):
                raise TypeError("message.content is not a string")
        except Exception as e:
            raise self._malformed(f"response body from {self.url} ({type(e).__name__})", raw, status=200) from None
        usage = data.get("usage") or {}
        message = assistant_message(content, tool_calls)
        text = render_action(message)
        pt, ct = usage.get("prompt_tokens"), usage.get("completion_tokens")
        pt = pt if isinstance(pt, int) else estimate_prompt_tokens(messages, self.tools)
        ct = ct if isinstance(ct, int) else min(self.max_tokens, len(text.encode("utf-8")) + 1)
        model, finish = str(data.get("model") or self.model), choice.get("finish_reason")
        return self.response(text, pt, ct, message=message, latency_s=latency, model=model, finish_reason=finish)

    def _status_error(
        self, status: int, body: bytes, retry_after: str | None, url: str | None = None
    ) -> TeacherCallError:
        snippet = self._snippet(body, ERROR_BODY_CHARS)
        hint = ""
        if status in (401, 403):
            hint = f" HINT: check the key in ${self.api_key_env}." if self.api_key_env else " HINT: set api_key_env."
        elif status == 404:
            hint = f" HINT: check base_url ({self.base_url}) and model ({self.model!r})."
        return TeacherCallError(
            f"teacher {self.id!r}: HTTP {status} from {url or self.url}: {snippet!r}.{hint}",
            retryable=status in RETRYABLE_STATUS,
            status=status,
            retry_after=parse_retry_after(retry_after),
            billed="no",
            kind=f"http_{status}",
        )

    async def complete(
        self, messages: Sequence[Mapping[str, Any]], *, metadata: Mapping[str, Any] | None = None
    ) -> TeacherResponse:
        payload = json_bytes(self.build_request(messages))
        t0 = time.perf_counter()
        body = await self._post(payload)
        return self._parse(body, messages, time.perf_counter() - t0)

    async def post_json(self, url: str, body: Mapping[str, Any]) -> Any:
        """POST ``body`` as JSON to ``url`` over this endpoint's transport (key, session, limits); the decoded answer.

        Other routes (``/completions``, a server's weight-reload route) get the error mapping of :meth:`complete`.
        """
        raw = await self._post(json_bytes(dict(body)), url)
        try:
            return json_loads(raw)
        except Exception:
            raise self._malformed(f"JSON from {url}", raw) from None

    def _malformed(self, what: str, raw: bytes, status: int | None = None) -> TeacherCallError:
        """An unreadable answer (retryable; it may have been billed), quoting the start of the scrubbed body."""
        return TeacherCallError(
            f"teacher {self.id!r}: malformed {what}: {self._snippet(raw, MALFORMED_BODY_CHARS)!r}",
            retryable=True,
            status=status,
            billed="maybe",
            kind="malformed",
        )

    # -- the transport -------------------------------------------------------------------
    # A failure before an attempt's ``_Sent`` flag is set (bad URL, DNS, refused connection, TLS, pool wait) cannot
    # have been billed: ``billed="no"``; after it, one without an answer may have been: ``billed="maybe"``.
    def _loop_session(self) -> Any:
        import asyncio

        loop = asyncio.get_running_loop()
        if self._session is not None and self._session_loop is loop and not getattr(self._session, "closed", False):
            return self._session
        import aiohttp

        connector = _connector_class()(limit=self.max_concurrency, ttl_dns_cache=300)
        self._session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            raise_for_status=False,
            trust_env=False,
        )
        self._session_loop = loop
        return self._session

    def _failed(self, e: BaseException, sent: bool, *, kind: str | None = None) -> TeacherCallError:
        """The :class:`TeacherCallError` of an attempt that got no HTTP response."""
        what = f"{type(e).__name__}: {self.scrub(str(e))}"
        client, nothing = kind == "client", "(nothing was sent, nothing billed)"
        if kind == "timeout" and not sent:
            text, label = f"could not connect to {self.base_url} within {self.timeout_s:g}s {nothing}", "connect"
        elif kind == "timeout":
            text, label = f"no response from {self.url} within {self.timeout_s:g}s", "timeout"
        elif not sent:
            text, label = f"cannot send to {self.url} {nothing}: {what}", "client" if client else "connect"
        else:
            text, label = (
                f"connection to {self.base_url} failed mid-request: {what}",
                "client" if client else "disconnect",
            )
        return TeacherCallError(
            f"teacher {self.id!r}: {text}", retryable=not client, billed="maybe" if sent else "no", kind=label
        )

    async def _post(self, payload: bytes, url: str | None = None) -> bytes:
        """POST ``payload`` (JSON bytes) to ``url`` (default: chat completions); the body of a 200 answer."""
        import aiohttp

        headers = self._headers()
        session = self._loop_session()
        flag = _Sent()
        token = _ATTEMPT.set(flag)
        try:
            async with session.post(url or self.url, data=payload, headers=headers) as resp:
                status, body, retry_after = resp.status, await resp.read(), resp.headers.get("Retry-After")
        except TimeoutError as e:  # also aiohttp's ConnectionTimeoutError (before sending)
            raise self._failed(e, flag.sent, kind="timeout") from None
        except (aiohttp.InvalidURL, getattr(aiohttp, "NonHttpUrlClientError", aiohttp.InvalidURL)):
            raise TeacherCallError(
                f"teacher {self.id!r}: the HTTP client refused the URL {self.url!r} (nothing was sent, nothing "
                "billed). HINT: base_url must look like https://host[:port]/v1",
                retryable=False,
                billed="no",
                kind="bad_url",
            ) from None
        except aiohttp.ClientError as e:
            raise self._failed(e, flag.sent) from None
        except Exception as e:  # anything else from the client (a bad header value ...): not worth retrying
            raise self._failed(e, flag.sent, kind="client") from None
        finally:
            _ATTEMPT.reset(token)
        if status != 200:
            raise self._status_error(status, body, retry_after, url)
        return body

    async def aclose(self) -> None:
        s, self._session, self._session_loop = self._session, None, None
        if s is not None:
            await s.close()
