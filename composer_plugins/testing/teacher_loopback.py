"""A loopback OpenAI-compatible chat-completions server with fault injection (tests, benchmarks, demos).

Run it as its own process (so client and server do not share a core): ``python -m
composer_plugins.testing.teacher_loopback --port 0``; it prints ``LISTENING <port>`` once ready. Its
deterministic answers, fault kinds and control routes (``/_stats``, ``/_config``, ``/_reset``): docs/replay.md
("Testing without a provider"). Answers are functions of the model name and the last user message (a
``tool`` model's argument JSON is formatted differently per model); ``prompt_tokens = ceil(request bytes / 4)``.
A wrong key gets a 401 echoing the received ``Authorization`` header, as some gateways do. Faults are planned
per request identity (model + messages): for the identities selected by ``fault_rate`` the n-th attempt gets
``plan[n]``, later attempts succeed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import hashlib
import json
import math
import os
import re
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

from composer_plugins.teachers.base import json_bytes, json_loads


@dataclass
class ServerConfig:
    """Behaviour of the loopback server (all settable through ``POST /_config``)."""

    latency_s: float = 0.0
    fault_rate: float = 0.0
    plan: list[str] = field(default_factory=lambda: ["429", "500", "timeout", "malformed"])
    retry_after: str = "1"
    hang_s: float = 2.0
    slow_s: float = 0.2
    seed: int = 0
    api_key_env: str | None = None
    fault_mode: str = "identity"
    echo_pad: int = 0


def request_identity(model: str, messages: Any) -> str:
    """The server's identity of a request (what "the same call" means for billing)."""
    blob = json.dumps({"model": model, "messages": messages}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:24]


def _last_user(messages: list[dict[str, Any]]) -> str:
    for m in reversed(messages):
        if m.get("role") == "user" and isinstance(m.get("content"), str):
            return m["content"]
    return ""


def scripted_answer(model: str, messages: list[dict[str, Any]]) -> tuple[str | None, list[dict[str, Any]] | None]:
    """The deterministic ``(content, tool_calls)`` the server returns for ``model`` and ``messages``."""
    content, calls = _answer_for(model, _last_user(messages))
    return content, json.loads(calls) if calls else None


@functools.lru_cache(maxsize=65536)
def _answer_for(model: str, text: str) -> tuple[str | None, str | None]:
    from composer_plugins.teachers.oracle import solve_arithmetic

    if "tool" in model:
        args = {"query": text[:40], "limit": 3}
        if int(hashlib.md5(model.encode()).hexdigest(), 16) % 2:
            arg_text = json.dumps(dict(reversed(list(args.items()))), indent=1)
        else:
            arg_text = json.dumps(args)
        call = {"id": f"call_{model}", "type": "function", "function": {"name": "search", "arguments": arg_text}}
        return None, json.dumps([call])
    ans = solve_arithmetic(text)
    if ans is not None:
        if "wrong" in model:
            ans = str(int(float(ans)) + 1) if re.fullmatch(r"-?\d+(\.0+)?", ans) else ans + "1"
        return f"#### {ans}", None
    h = hashlib.sha1(text.encode()).hexdigest()[:8]
    return (f"echo:{h}" if "wrong" not in model else f"echo:{h}-x"), None


class LoopbackServer:
    """The aiohttp application and its counters."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.in_flight = 0  # requests being handled now (not cleared by reset: handlers may still run)
        self.reset()

    def reset(self) -> None:
        self.requests = 0
        self.by_status: Counter[str] = Counter()
        self.attempts: Counter[str] = Counter()
        self.billed: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])  # count, prompt, completion
        self.undelivered: Counter[str] = Counter()  # billed answers the client cannot have used
        self.undelivered_usage: dict[str, list[int]] = defaultdict(lambda: [0, 0])  # prompt, completion
        self.times: dict[str, list[float]] = defaultdict(list)  # arrival time of each attempt
        self.kinds: dict[str, list[str]] = defaultdict(list)  # what each attempt got ("ok" or the fault)
        self.started = time.time()

    def _faulty(self, ident: str) -> bool:
        if self.config.fault_rate <= 0:
            return False
        h = int(hashlib.sha256(f"{self.config.seed}:{ident}".encode()).hexdigest()[:8], 16)
        return (h % 10_000) < self.config.fault_rate * 10_000

    def _fault(self, ident: str, attempt: int) -> str | None:
        cfg = self.config
        if cfg.fault_mode == "attempt":
            if cfg.fault_rate <= 0 or not cfg.plan:
                return None
            h = int(hashlib.sha256(f"{cfg.seed}:{ident}:{attempt}".encode()).hexdigest()[:12], 16)
            if (h % 10_000) >= cfg.fault_rate * 10_000:
                return None
            return cfg.plan[(h // 10_000) % len(cfg.plan)]
        return cfg.plan[attempt] if self._faulty(ident) and attempt < len(cfg.plan) else None

    def _attempt(self, ident: str) -> tuple[int, str | None]:
        """Count one more attempt at ``ident``: ``(its index, the fault it gets or None)``."""
        attempt = self.attempts[ident]
        self.attempts[ident] += 1
        self.times[ident].append(time.monotonic())
        fault = self._fault(ident, attempt)
        self.kinds[ident].append(fault or "ok")
        return attempt, fault

    def _bill(self, ident: str, prompt_tokens: int, completion_tokens: int) -> None:
        b = self.billed[ident]
        b[0] += 1
        b[1] += prompt_tokens
        b[2] += completion_tokens

    def _lost(self, ident: str, prompt_tokens: int, completion_tokens: int) -> None:
        self.undelivered[ident] += 1
        u = self.undelivered_usage[ident]
        u[0] += prompt_tokens
        u[1] += completion_tokens

    def _auth_ok(self, header: str | None) -> bool:
        env = self.config.api_key_env
        if not env:
            return True
        return header == f"Bearer {os.environ.get(env, '')}"

    async def chat(self, request: Any) -> Any:
        self.in_flight += 1
        try:
            return await self._chat(request)
        finally:
            self.in_flight -= 1

    async def _chat(self, request: Any) -> Any:
        from aiohttp import web

        raw = await request.read()
        self.requests += 1
        if not self._auth_ok(request.headers.get("Authorization")):
            self.by_status["401"] += 1
            # echo what was received, like some gateways do: clients must scrub it from errors
            got = request.headers.get("Authorization", "")
            pad = "." * self.config.echo_pad
            body = json_bytes(
                {"error": {"message": f"Incorrect API key provided{pad}: {got}", "type": "invalid_request_error"}}
            )
            return web.Response(status=401, body=body, content_type="application/json")
        try:
            req = json_loads(raw)
            model, messages = req["model"], req["messages"]
        except Exception:
            self.by_status["400"] += 1
            return web.Response(
                status=400, body=b'{"error":{"message":"bad request"}}', content_type="application/json"
            )
        ident = request_identity(model, messages)
        attempt, fault = self._attempt(ident)
        failed = await self.inject_fault(request, fault, b'{"id": "x", "choices": [{"message": {"role": "assis')
        if failed is not None:
            return failed
        if fault == "echo":
            self.by_status["echo"] += 1
            got = request.headers.get("Authorization", "").removeprefix("Bearer ")  # the bare key
            pad = "." * self.config.echo_pad
            leaky = f'{{"upstream": "{pad}{got}", "choi'.encode()
            return web.Response(status=200, body=leaky, content_type="application/json")
        content, tool_calls = scripted_answer(model, messages)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if tool_calls:
            message["tool_calls"] = tool_calls
        prompt_tokens = math.ceil(len(raw) / 4)
        completion_tokens = max(1, math.ceil(len(json_bytes(message)) / 4))
        max_tokens = req.get("max_tokens") or req.get("max_completion_tokens")
        if isinstance(max_tokens, int):
            completion_tokens = min(completion_tokens, max_tokens)
        self._bill(ident, prompt_tokens, completion_tokens)
        if fault == "billed_drop":
            self.by_status["billed_drop"] += 1
            self._lost(ident, prompt_tokens, completion_tokens)
            return self._drop(request)
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        if fault == "empty":
            self.by_status["empty"] += 1
            self._lost(ident, prompt_tokens, completion_tokens)
            empty = {"id": f"chatcmpl-{ident[:12]}-{attempt}", "model": model, "choices": [], "usage": usage}
            return web.Response(body=json_bytes(empty), content_type="application/json")
        self.by_status["200"] += 1
        body = {
            "id": f"chatcmpl-{ident[:12]}-{attempt}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": message, "finish_reason": "tool_calls" if tool_calls else "stop"}],
            "usage": usage,
        }
        if fault == "slow_body":
            return await self._slow_body(request, ident, json_bytes(body), prompt_tokens, completion_tokens)
        return web.Response(body=json_bytes(body), content_type="application/json")

    async def inject_fault(self, request: Any, fault: str | None, truncated_body: bytes) -> Any:
        """Apply the latency and the request-level ``fault`` (429/5xx, hang, malformed, slow, drop).

        Returns the response that ends the request, or ``None`` when the handler goes on to answer
        (no fault, ``slow`` after its delay, or a fault the handler applies itself). ``truncated_body``
        is the endpoint's own answer cut short, served for ``malformed``.
        """
        from aiohttp import web

        cfg = self.config
        if cfg.latency_s:
            await asyncio.sleep(cfg.latency_s)
        if fault in ("429", "500", "502", "503"):
            self.by_status[fault] += 1
            headers = {"Retry-After": cfg.retry_after} if fault == "429" else {}
            msg = b'{"error":{"message":"rate limited"}}' if fault == "429" else b'{"error":{"message":"upstream"}}'
            return web.Response(status=int(fault), body=msg, headers=headers, content_type="application/json")
        if fault == "timeout":
            self.by_status["timeout"] += 1
            await asyncio.sleep(cfg.hang_s)
            return web.Response(status=504, body=b'{"error":{"message":"gateway timeout"}}')
        if fault == "malformed":
            self.by_status["malformed"] += 1
            return web.Response(status=200, body=truncated_body, content_type="application/json")
        if fault == "slow":
            await asyncio.sleep(cfg.slow_s)
        if fault == "drop":
            self.by_status["drop"] += 1
            return self._drop(request)
        return None

    def _drop(self, request: Any) -> Any:
        """Close the connection without an answer (the client sees a dropped connection)."""
        from aiohttp import web

        if request.transport is not None:
            request.transport.abort()
        return web.Response(status=200)  # never reaches the client: the transport is gone

    async def _slow_body(self, request: Any, ident: str, data: bytes, pt: int, ct: int) -> Any:
        from aiohttp import web

        self.by_status["slow_body"] += 1
        resp = web.StreamResponse(status=200, headers={"Content-Type": "application/json"})
        resp.content_length = len(data)
        try:
            await resp.prepare(request)
            await resp.write(data[: len(data) // 2])
            await asyncio.sleep(self.config.slow_s)
            if request.transport is None or request.transport.is_closing():
                raise ConnectionResetError("client went away")
            await resp.write(data[len(data) // 2 :])
            await resp.write_eof()
        except (ConnectionError, RuntimeError):
            self._lost(ident, pt, ct)
        return resp

    async def stats(self, request: Any) -> Any:
        from aiohttp import web

        data = {
            "requests": self.requests,
            "in_flight": self.in_flight,
            "by_status": dict(self.by_status),
            "billed_calls": sum(v[0] for v in self.billed.values()),
            "billed": dict(self.billed),
            "undelivered": dict(self.undelivered),
            "undelivered_usage": dict(self.undelivered_usage),
            "attempts": dict(self.attempts),
            "faulty": [k for k in self.attempts if self._faulty(k)],
            "times": dict(self.times),
            "kinds": dict(self.kinds),
            "config": asdict(self.config),
        }
        return web.Response(body=json_bytes(data), content_type="application/json")

    async def set_config(self, request: Any) -> Any:
        from aiohttp import web

        upd = json_loads(await request.read())
        for k, v in upd.items():
            if not hasattr(self.config, k):
                return web.Response(status=400, text=f"unknown config key {k!r}")
            setattr(self.config, k, v)
        return web.Response(body=json_bytes(asdict(self.config)), content_type="application/json")

    async def do_reset(self, request: Any) -> Any:
        from aiohttp import web

        self.reset()
        return web.Response(text="ok")

    def app(self) -> Any:
        from aiohttp import web

        app = web.Application(client_max_size=64 * 1024**2)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_get("/_stats", self.stats)
        app.router.add_post("/_config", self.set_config)
        app.router.add_post("/_reset", self.do_reset)
        return app


def serve_forever(make_app: Any, host: str, port: int) -> None:
    """Serve the aiohttp app ``make_app()`` on ``host:port`` (loopback only) and print ``LISTENING <port>``."""
    if host not in ("127.0.0.1", "localhost", "::1"):
        raise SystemExit("the loopback server only binds to 127.0.0.1/localhost")

    async def run() -> None:
        from aiohttp import web

        runner = web.AppRunner(make_app(), access_log=None, handle_signals=False)
        await runner.setup()
        site = web.TCPSite(runner, host, port, backlog=1024, reuse_address=True)
        await site.start()
        sock = site._server.sockets[0]  # type: ignore[union-attr]
        print(f"LISTENING {sock.getsockname()[1]}", flush=True)
        while True:
            await asyncio.sleep(3600)

    with contextlib.suppress(KeyboardInterrupt):  # pragma: no cover
        asyncio.run(run())


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point (``python -m composer_plugins.testing.teacher_loopback``)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--latency", type=float, default=0.0, help="seconds added to every answer")
    ap.add_argument("--config", default=None, help="JSON ServerConfig fields")
    ap.add_argument("--api-key-env", default=None, help="require 'Bearer $VAR' on every request")
    a = ap.parse_args(argv)
    cfg = ServerConfig(latency_s=a.latency, api_key_env=a.api_key_env)
    if a.config:
        for k, v in json.loads(a.config).items():
            setattr(cfg, k, v)
    serve_forever(LoopbackServer(cfg).app, a.host, a.port)


class LoopbackProcess:
    """Start the server in a subprocess and talk to its control endpoints (context manager).

    Example::

        with LoopbackProcess(latency_s=0.01) as srv:
            teacher = OpenAITeacher("m", base_url=srv.base_url, api_key_env=None)
    """

    #: The module run with ``python -m`` (a server built on this one names its own).
    module = "composer_plugins.testing.teacher_loopback"

    def __init__(
        self, *, env: dict[str, str] | None = None, cpu: int | None = None, args: list[str] | None = None, **config: Any
    ) -> None:
        self.config = config
        self.args = list(args or [])
        self.env = env
        self.cpu = cpu
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, timeout: float = 60.0) -> LoopbackProcess:
        cmd = [sys.executable, "-m", self.module, "--port", "0", *self.args]
        if self.config:
            cmd += ["--config", json.dumps(dict(self.config))]
        env = {**os.environ, **(self.env or {})}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        if self.cpu is not None and hasattr(os, "sched_setaffinity"):
            with contextlib.suppress(OSError):
                os.sched_setaffinity(self.proc.pid, {self.cpu})
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        line = ""
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.startswith("LISTENING"):
                self.port = int(line.split()[1])
                return self
            if self.proc.poll() is not None:
                break
        self.stop()
        raise RuntimeError(f"loopback server did not start (last output {line!r})")

    def _request(self, method: str, path: str, body: Any = None) -> Any:
        import urllib.request

        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", data=data, method=method)
        req.add_header("Content-Type", "application/json")
        with urllib.request.urlopen(req, timeout=30) as r:
            raw = r.read()
        return json.loads(raw) if raw[:1] in (b"{", b"[") else raw.decode()

    def stats(self) -> dict[str, Any]:
        """The server's counters."""
        return self._request("GET", "/_stats")

    def configure(self, **updates: Any) -> dict[str, Any]:
        """Change latency/faults at run time."""
        return self._request("POST", "/_config", updates)

    def reset(self) -> None:
        """Clear the counters."""
        self._request("POST", "/_reset", {})

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()
        self.proc = None

    def __enter__(self) -> LoopbackProcess:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


if __name__ == "__main__":
    main()
