"""Fixtures for the teacher / replay tests: one real loopback OpenAI-compatible server per session."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from composer_plugins.teachers.traces import TraceState
from composer_plugins.testing.teacher_loopback import LoopbackProcess

KEY_ENV = "CP_TEACHERS_TEST_KEY"
SECRET = "sk-test-SUPERSECRET-7f3a9c"
PROMPT_PRICE = 1e-6
COMPLETION_PRICE = 4e-6
DEFAULT_SERVER = {
    "latency_s": 0.0,
    "fault_rate": 0.0,
    "plan": ["429", "500", "timeout", "malformed"],
    "retry_after": "1",
    "hang_s": 2.0,
    "slow_s": 0.2,
    "seed": 0,
    "fault_mode": "identity",
    "echo_pad": 0,
}


@pytest.fixture(scope="session")
def loopback_server() -> Iterator[LoopbackProcess]:
    """The server process (requires ``Bearer $CP_TEACHERS_TEST_KEY``)."""
    os.environ[KEY_ENV] = SECRET
    srv = LoopbackProcess(env={KEY_ENV: SECRET}, api_key_env=KEY_ENV).start()
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def srv(loopback_server: LoopbackProcess) -> LoopbackProcess:
    """The session server with counters cleared and default behaviour restored."""
    os.environ[KEY_ENV] = SECRET
    loopback_server.configure(**DEFAULT_SERVER)
    loopback_server.reset()
    return loopback_server


@pytest.fixture
def make_teacher(srv: LoopbackProcess) -> Callable[..., Any]:
    """Factory for ``OpenAITeacher`` objects pointed at the loopback server."""
    from composer_plugins.teachers.openai_compat import OpenAITeacher

    def _make(model: str, **kw: Any) -> OpenAITeacher:
        args: dict[str, Any] = {
            "base_url": srv.base_url,
            "api_key_env": KEY_ENV,
            "prompt_usd_per_token": PROMPT_PRICE,
            "completion_usd_per_token": COMPLETION_PRICE,
            "max_tokens": 32,
            "timeout_s": 5.0,
            "max_concurrency": 4,
        }
        args.update(kw)
        return OpenAITeacher(model, **args)

    return _make


def arithmetic_states(n: int, wrong_every: int = 2, offset: int = 0) -> list[TraceState]:
    """``n`` one-step states ``What is a + b?``; every ``wrong_every``-th student answer is off by one."""
    out = []
    for i in range(offset, offset + n):
        a, b = 2 + i, 5 + 3 * i
        ans = a + b + (1 if wrong_every and i % wrong_every == 0 else 0)
        out.append(
            TraceState(
                state_id=f"arith-{i}#0",
                messages=[{"role": "user", "content": f"What is {a} + {b}?"}],
                student_action={"role": "assistant", "content": f"#### {ans}"},
                trace_id=f"arith-{i}",
                metadata={"answer": str(a + b)},
            )
        )
    return out


@pytest.fixture
def states_factory() -> Callable[..., list[TraceState]]:
    return arithmetic_states


def server_cost(billed: dict[str, list[int]]) -> float:
    """What the server's successful answers cost at the test prices."""
    return sum(pt * PROMPT_PRICE + ct * COMPLETION_PRICE for _, pt, ct in billed.values())


@pytest.fixture
def cost_of() -> Callable[[dict[str, list[int]]], float]:
    return server_cost
