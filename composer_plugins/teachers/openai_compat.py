"""The ``openai`` teacher: any OpenAI-compatible chat-completions endpoint over async HTTP.

Works with OpenAI, OpenRouter, vLLM, llama.cpp / a local server: anything that serves
``POST {base_url}/chat/completions``. The API key is read from the environment variable
named by ``api_key_env`` and held as a :class:`~composer_plugins.core.config.Secret`; it is
only revealed to build the ``Authorization`` header and is scrubbed from every error text.

Two HTTP clients are supported: ``aiohttp`` (the default) and ``httpx``. Measured on the
loopback benchmark (``python -m benchmarks.bench_replay``), httpx's async pool tops out
around 200 calls/s at 64 concurrent requests while aiohttp sustains thousands, so aiohttp
is the default and httpx is kept for environments that prefer it.
"""

from __future__ import annotations

import email.utils
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from composer_plugins.core.config import Secret
from composer_plugins.teachers.base import (
    Teacher,
    TeacherCallError,
    TeacherError,
    TeacherResponse,
    assistant_message,
    estimate_prompt_tokens,
    render_action,
)

try:  # orjson is optional; it parses responses ~5x faster than json
    import orjson as _orjson

    def _loads(data: bytes) -> Any:
        return _orjson.loads(data)

    def _dumps(obj: Any) -> bytes:
        return _orjson.dumps(obj)

except ImportError:  # pragma: no cover - depends on the environment
    import json as _json

    def _loads(data: bytes) -> Any:
        return _json.loads(data)

    def _dumps(obj: Any) -> bytes:
        return _json.dumps(obj, ensure_ascii=False).encode("utf-8")


RETRYABLE_STATUS = frozenset({408, 409, 425, 429, 500, 502, 503, 504, 520, 522, 524, 529})


def parse_retry_after(value: str | None, now: float | None = None) -> float | None:
    """Seconds to wait from a ``Retry-After`` header (delta-seconds or an HTTP date); ``None`` if absent/bad."""
    if value is None:
        return None
    value = value.strip()
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
    if dt is None:
        return None
    return max(0.0, dt.timestamp() - (now if now is not None else time.time()))


class OpenAITeacher(Teacher):
    """A teacher served by an OpenAI-compatible chat-completions endpoint (async HTTP).

    Args:
        model: the model name sent in the request.
        base_url: endpoint root, e.g. ``https://openrouter.ai/api/v1`` or ``http://127.0.0.1:8000/v1``.
        api_key_env: name of the environment variable holding the key (``None``: send no key).
        id: the teacher's name in the run (defaults to ``model``).
        prompt_usd_per_token, completion_usd_per_token: prices for cost accounting and the budget.
        max_tokens: completion cap sent with every request (and used for the worst-case reservation).
        temperature, top_p, seed, stop: sampling parameters (part of the cache key).
        tools: OpenAI tool schemas sent with every request (so teachers can answer with tool calls).
        extra_body: more JSON fields for the request (e.g. OpenRouter ``provider`` routing).
        max_tokens_param: the request field for the cap (``max_completion_tokens`` for newer OpenAI models).
        timeout_s: total time limit of one attempt.
        max_concurrency: most requests in flight at once for this teacher.
        http_client: ``"aiohttp"`` (default, fastest) or ``"httpx"``.
        headers: extra HTTP headers (e.g. OpenRouter ``HTTP-Referer``); never put the key here.
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
        http_client: Literal["aiohttp", "httpx"] = "aiohttp",
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
        if not model:
            raise TeacherError("openai teacher: `model` is required (the model name sent to the endpoint)")
        if http_client not in ("aiohttp", "httpx"):
            raise TeacherError(
                f"openai teacher {self.id!r}: http_client must be 'aiohttp' or 'httpx', got {http_client!r}"
            )
        if api_key_env is not None and (not isinstance(api_key_env, str) or not api_key_env.isidentifier()):
            raise TeacherError(
                f"openai teacher {self.id!r}: api_key_env must be the NAME of an environment variable "
                "(e.g. OPENROUTER_API_KEY), not the key itself"
            )
        for h in headers or {}:
            if h.lower() in ("authorization", "api-key", "x-api-key"):
                raise TeacherError(
                    f"openai teacher {self.id!r}: do not pass the key in headers; set api_key_env to the variable name"
                )
        self.base_url = base_url.rstrip("/")
        self.url = self.base_url + "/chat/completions"
        self.api_key_env = api_key_env
        self.temperature = temperature
        self.top_p = top_p
        self.seed = seed
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
    def cache_params(self) -> dict[str, Any]:
        p: dict[str, Any] = {"max_tokens": self.max_tokens}
        for k in ("temperature", "top_p", "seed", "stop", "tools"):
            v = getattr(self, k)
            if v is not None:
                p[k] = v
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

    def _scrub(self, text: str) -> str:
        key = self._api_key
        if key is not None:
            raw = key.reveal()
            if raw and raw in text:
                text = text.replace(raw, "****")
        return text

    def _headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json", **self.extra_headers}
        key = self._key()
        if key is not None:
            h["Authorization"] = "Bearer " + key.reveal()
        return h

    # -- request / response --------------------------------------------------------------
    def build_request(self, messages: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """The JSON body sent for ``messages``."""
        body: dict[str, Any] = {"model": self.model, "messages": list(messages), self.max_tokens_param: self.max_tokens}
        for k in ("temperature", "top_p", "seed", "stop", "tools"):
            v = getattr(self, k)
            if v is not None:
                body[k] = v
        body.update(self.extra_body)
        return body

    def _parse(self, raw: bytes, messages: Sequence[Mapping[str, Any]], latency: float) -> TeacherResponse:
        try:
            data = _loads(raw)
            choice = data["choices"][0]
            msg = choice["message"]
            content = msg.get("content")
            tool_calls = msg.get("tool_calls") or None
            if content is not None and not isinstance(content, str):
                raise TypeError("message.content is not a string")
        except Exception as e:
            raise TeacherCallError(
                f"teacher {self.id!r}: malformed response body from {self.url} ({type(e).__name__}): "
                f"{self._scrub(raw[:200].decode('utf-8', 'replace'))!r}",
                retryable=True,
                status=200,
                billed="maybe",
                kind="malformed",
            ) from None
        usage = data.get("usage") or {}
        message = assistant_message(content, tool_calls)
        text = render_action(message)
        pt = usage.get("prompt_tokens")
        ct = usage.get("completion_tokens")
        if not isinstance(pt, int):
            pt = estimate_prompt_tokens(messages, self.tools)
        if not isinstance(ct, int):
            ct = min(self.max_tokens, len(text.encode("utf-8")) + 1)
        return TeacherResponse(
            text=text,
            message=message,
            prompt_tokens=pt,
            completion_tokens=ct,
            cost_usd=self.cost(pt, ct),
            latency_s=latency,
            model=str(data.get("model") or self.model),
            teacher=self.id,
            finish_reason=choice.get("finish_reason"),
        )

    def _status_error(self, status: int, body: bytes, retry_after: str | None) -> TeacherCallError:
        snippet = self._scrub(body[:300].decode("utf-8", "replace"))
        retryable = status in RETRYABLE_STATUS
        hint = ""
        if status in (401, 403):
            hint = f" HINT: check the key in ${self.api_key_env}." if self.api_key_env else " HINT: set api_key_env."
        elif status == 404:
            hint = f" HINT: check base_url ({self.base_url}) and model ({self.model!r})."
        return TeacherCallError(
            f"teacher {self.id!r}: HTTP {status} from {self.url}: {snippet!r}.{hint}",
            retryable=retryable,
            status=status,
            retry_after=parse_retry_after(retry_after),
            billed="no",
            kind=f"http_{status}",
        )

    async def complete(
        self, messages: Sequence[Mapping[str, Any]], *, metadata: Mapping[str, Any] | None = None
    ) -> TeacherResponse:
        payload = _dumps(self.build_request(messages))
        headers = self._headers()
        t0 = time.perf_counter()
        if self.http_client == "aiohttp":
            status, body, retry_after = await self._post_aiohttp(payload, headers)
        else:
            status, body, retry_after = await self._post_httpx(payload, headers)
        latency = time.perf_counter() - t0
        if status != 200:
            raise self._status_error(status, body, retry_after)
        return self._parse(body, messages, latency)

    # -- aiohttp -------------------------------------------------------------------------
    def _loop_session(self) -> Any:
        import asyncio

        loop = asyncio.get_running_loop()
        if self._session is not None and self._session_loop is loop and not self._session_closed():
            return self._session
        if self.http_client == "aiohttp":
            import aiohttp

            connector = aiohttp.TCPConnector(limit=self.max_concurrency, ttl_dns_cache=300)
            self._session = aiohttp.ClientSession(
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                raise_for_status=False,
                trust_env=False,
            )
        else:
            import httpx

            limits = httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency)
            self._session = httpx.AsyncClient(limits=limits, timeout=self.timeout_s, trust_env=False)
        self._session_loop = loop
        return self._session

    def _session_closed(self) -> bool:
        s = self._session
        return bool(getattr(s, "closed", False) or getattr(s, "is_closed", False))

    async def _post_aiohttp(self, payload: bytes, headers: dict[str, str]) -> tuple[int, bytes, str | None]:

        import aiohttp

        session = self._loop_session()
        try:
            async with session.post(self.url, data=payload, headers=headers) as resp:
                body = await resp.read()
                return resp.status, body, resp.headers.get("Retry-After")
        except TimeoutError:
            raise self._timeout_error() from None
        except aiohttp.ClientConnectorError as e:
            raise TeacherCallError(
                f"teacher {self.id!r}: cannot connect to {self.base_url}: {self._scrub(str(e.os_error))}",
                retryable=True,
                billed="no",
                kind="connect",
            ) from None
        except aiohttp.ClientError as e:
            raise TeacherCallError(
                f"teacher {self.id!r}: connection to {self.base_url} failed mid-request: "
                f"{type(e).__name__}: {self._scrub(str(e))}",
                retryable=True,
                billed="maybe",
                kind="disconnect",
            ) from None

    async def _post_httpx(self, payload: bytes, headers: dict[str, str]) -> tuple[int, bytes, str | None]:
        import httpx

        client = self._loop_session()
        try:
            resp = await client.post(self.url, content=payload, headers=headers)
        except httpx.TimeoutException:
            raise self._timeout_error() from None
        except httpx.ConnectError as e:
            raise TeacherCallError(
                f"teacher {self.id!r}: cannot connect to {self.base_url}: {self._scrub(str(e))}",
                retryable=True,
                billed="no",
                kind="connect",
            ) from None
        except httpx.HTTPError as e:
            raise TeacherCallError(
                f"teacher {self.id!r}: connection to {self.base_url} failed mid-request: "
                f"{type(e).__name__}: {self._scrub(str(e))}",
                retryable=True,
                billed="maybe",
                kind="disconnect",
            ) from None
        return resp.status_code, resp.content, resp.headers.get("Retry-After")

    def _timeout_error(self) -> TeacherCallError:
        return TeacherCallError(
            f"teacher {self.id!r}: no response from {self.url} within {self.timeout_s:g}s",
            retryable=True,
            billed="maybe",
            kind="timeout",
        )

    async def aclose(self) -> None:
        s, self._session, self._session_loop = self._session, None, None
        if s is None:
            return
        if self.http_client == "aiohttp":
            await s.close()
        else:
            await s.aclose()
