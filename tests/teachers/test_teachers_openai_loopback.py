"""The ``openai`` teacher and the replay engine against a real OpenAI-compatible server on 127.0.0.1."""

from __future__ import annotations

import logging
import os

import pytest

from composer_plugins.teachers.base import TeacherCallError, TeacherError
from composer_plugins.teachers.cache import ReplayCache
from composer_plugins.teachers.engine import ReplayEngine, RetryPolicy
from composer_plugins.teachers.pairs import extract_pairs
from composer_plugins.testing.teacher_loopback import request_identity

KEY_ENV = "CP_TEACHERS_TEST_KEY"  # same as conftest.py
SECRET = "sk-test-SUPERSECRET-7f3a9c"

FAST_RETRY = RetryPolicy(max_retries=8, backoff_base_s=0.01, backoff_max_s=0.05)


def test_single_call_returns_text_usage_cost_latency(srv, make_teacher):
    t = make_teacher("teacher-a")
    r = t.act([{"role": "user", "content": "What is 6 * 7?"}])
    assert r.text == "#### 42"
    assert r.message == {"role": "assistant", "content": "#### 42"}
    assert r.prompt_tokens > 0 and r.completion_tokens > 0
    assert r.cost_usd == pytest.approx(r.prompt_tokens * 1e-6 + r.completion_tokens * 4e-6)
    assert r.latency_s > 0 and r.teacher == "teacher-a" and r.model == "teacher-a"
    # the worst-case reservation bounds the real cost
    assert t.max_cost([{"role": "user", "content": "What is 6 * 7?"}]) >= r.cost_usd
    assert srv.stats()["billed_calls"] == 1


def test_tool_call_answers_are_parsed(srv, make_teacher):
    r = make_teacher("tool-x").act([{"role": "user", "content": "find cats"}])
    calls = r.message["tool_calls"]
    assert calls[0]["function"]["name"] == "search"
    assert '"tool": "search"' in r.text


@pytest.mark.parametrize("client", ["aiohttp"])  # the one transport (httpx removed: bench_replay)
def test_faults_nothing_lost_nothing_paid_twice(srv, make_teacher, states_factory, cost_of, tmp_path, client):
    """429 + Retry-After, 500, timeouts, malformed JSON and slow answers: every call lands, each billed once."""
    # the client timeout is far above any normal answer time (a spurious timeout would be a real double charge)
    srv.configure(fault_rate=0.3, plan=["429", "500", "timeout", "malformed", "slow"], hang_s=5.0, slow_s=0.1)
    states = states_factory(10)
    teachers = [make_teacher(m, timeout_s=2.0, http_client=client) for m in ("teacher-a", "teacher-b")]
    with ReplayCache(tmp_path / "c.sqlite") as cache:
        res = ReplayEngine(teachers, cache=cache, retry=FAST_RETRY, progress=False).run(states)
        assert len(cache) == 20
    st = srv.stats()
    # nothing lost
    assert not res.failures
    assert all(set(v) == {"teacher-a", "teacher-b"} for v in res.responses.values())
    assert all(r.text.startswith("#### ") for v in res.responses.values() for r in v.values())
    # faults were really injected, and every one was retried
    faulty = st["faulty"]
    assert faulty, "the fault plan selected no request"
    assert all(st["attempts"][k] == 5 for k in faulty)  # 4 failures, then a slow success
    assert all(n == 1 for k, n in st["attempts"].items() if k not in faulty)
    for status in ("429", "500", "timeout", "malformed"):
        assert st["by_status"][status] == len(faulty)
    assert res.stats.retries == 4 * len(faulty)
    # no call paid twice: each identity billed exactly once, and we account exactly what the server billed
    assert len(st["billed"]) == 20 and all(v[0] == 1 for v in st["billed"].values())
    assert res.stats.completed == 20
    assert res.stats.spent_usd == pytest.approx(cost_of(st["billed"]), rel=1e-9)
    # timeouts and unreadable bodies may have been billed by a real provider: counted at worst case
    assert res.stats.uncertain_usd > 0
    # Retry-After honoured: the attempt after a 429 arrived at least 1 s later
    for k in faulty:
        t = st["times"][k]
        assert t[1] - t[0] >= 0.95


def test_budget_ceiling_is_never_exceeded(srv, make_teacher, states_factory, cost_of, tmp_path):
    states = states_factory(30)
    teachers = [make_teacher(m, max_concurrency=8) for m in ("teacher-a", "teacher-b")]
    one = teachers[0].max_cost(states[0].messages)
    ceiling = one * 20  # room for ~20 of 60 worst-case calls
    with ReplayCache(tmp_path / "c.sqlite") as cache:
        res = ReplayEngine(teachers, cache=cache, max_usd=ceiling, progress=False, run_id="cap").run(states)
        totals = cache.run_totals("cap")
    st = srv.stats()
    assert res.stats.skipped_budget > 0
    assert 0 < res.stats.completed < 60
    assert res.stats.spent_usd + res.stats.uncertain_usd <= ceiling
    assert cost_of(st["billed"]) <= ceiling
    assert totals.total_usd <= ceiling
    assert totals.paid_calls == res.stats.completed == st["billed_calls"]
    assert totals.uncertain_calls == 0  # a clean exit drops its spend lease
    assert {f.kind for f in res.failures} == {"budget"}
    # a second run with the same run_id starts from what the first spent: the ceiling holds across runs
    before = st["requests"]
    with ReplayCache(tmp_path / "c.sqlite") as cache:
        res2 = ReplayEngine(teachers, cache=cache, max_usd=ceiling, progress=False, run_id="cap").run(states)
    assert res2.stats.cache_hits == res.stats.completed
    assert res2.stats.prior_spent_usd == pytest.approx(res.stats.spent_usd)
    assert srv.stats()["requests"] - before == res2.stats.calls
    assert res2.stats.total_spent_usd <= ceiling


def test_orphaned_reservations_count_at_worst_case(srv, make_teacher, states_factory, tmp_path):
    """A reservation left 'pending' by a dead process still counts against the ceiling after a restart."""
    states = states_factory(4)
    t = make_teacher("teacher-a")
    worst = t.max_cost(states[0].messages)
    with ReplayCache(tmp_path / "c.sqlite") as cache:
        cache.submit(ReplayCache.ledger_stmts("dead-attempt", "r1", "k", "teacher-a", "pending", 10 * worst)).result()
        res = ReplayEngine([t], cache=cache, max_usd=11 * worst, run_id="r1", progress=False).run(states)
        assert res.stats.prior_uncertain_usd == pytest.approx(10 * worst)
        assert res.stats.completed == 1 and res.stats.skipped_budget == 3  # only one more worst case fits
        assert res.stats.total_spent_usd <= 11 * worst
        res = ReplayEngine([t], cache=cache, max_usd=11 * worst, run_id="r1", progress=False, fresh_budget=True).run(
            states
        )
        assert res.stats.completed == 3 and res.stats.cache_hits == 1


def test_identical_requests_are_sent_once(srv, make_teacher, states_factory, tmp_path):
    states = states_factory(3) + [
        s.__class__(**{**s.to_dict(), "state_id": s.state_id + "-copy"}) for s in states_factory(3)
    ]
    with ReplayCache(tmp_path / "c.sqlite") as cache:
        res = ReplayEngine([make_teacher("teacher-a")], cache=cache, progress=False).run(states)
    assert res.stats.deduplicated == 3 and res.stats.calls == 3
    assert srv.stats()["billed_calls"] == 3
    assert len(res.responses) == 6 and all(len(v) == 1 for v in res.responses.values())


def test_warm_cache_rerun_sends_nothing(srv, make_teacher, states_factory, tmp_path):
    states = states_factory(10)
    teachers = [make_teacher(m) for m in ("teacher-a", "teacher-b")]
    with ReplayCache(tmp_path / "c.sqlite") as cache:
        ReplayEngine(teachers, cache=cache, progress=False).run(states)
    n = srv.stats()["requests"]
    with ReplayCache(tmp_path / "c.sqlite") as cache:
        res = ReplayEngine(teachers, cache=cache, progress=False).run(states)
    assert srv.stats()["requests"] == n
    assert res.stats.calls == 0 and res.stats.cache_hits == 20
    assert all(r.cached for v in res.responses.values() for r in v.values())
    # changing a sampling parameter changes the key: those calls are new
    with ReplayCache(tmp_path / "c.sqlite") as cache:
        res = ReplayEngine([make_teacher("teacher-a", temperature=0.7)], cache=cache, progress=False).run(states)
    assert res.stats.calls == 10


def test_consensus_pairs_from_real_teachers(srv, make_teacher, states_factory):
    from composer_plugins.teachers.oracle import OracleTeacher

    states = states_factory(6, wrong_every=2)
    teachers = [make_teacher("teacher-a"), make_teacher("teacher-b"), make_teacher("c-wrong"), OracleTeacher()]
    res = ReplayEngine(teachers, progress=False).run(states)
    pairs, stats = extract_pairs(states, res.responses, k=3, teacher_order=res.teachers)
    assert stats.pairs == 3 and stats.student_agrees == 3
    for p in pairs:
        assert p["teachers"] == ["teacher-a", "teacher-b", "oracle"]
        assert p["chosen"] == f"#### {p['metadata']['answer']}"
        assert p["rejected"] != p["chosen"]
        assert set(p["dissent"]) == {"c-wrong"}


def test_non_retryable_errors_fail_fast(srv, make_teacher, states_factory):
    t = make_teacher("teacher-a", base_url=srv.base_url.replace("/v1", "/nope"))
    res = ReplayEngine([t], retry=FAST_RETRY, progress=False).run(states_factory(2))
    assert {f.kind for f in res.failures} == {"http_404"}
    assert all(f.attempts == 1 for f in res.failures)
    assert "HINT" in res.failures[0].message


def test_unreachable_endpoint_is_retried_then_reported(make_teacher, states_factory):
    t = make_teacher("teacher-a", base_url="http://127.0.0.1:9/v1")
    res = ReplayEngine([t], retry=RetryPolicy(max_retries=2, backoff_base_s=0.01), progress=False).run(
        states_factory(1)
    )
    assert res.failures[0].kind == "connect" and res.failures[0].attempts == 3
    assert res.stats.spent_usd == 0 and res.stats.uncertain_usd == 0  # never connected: never billed


# -- secrets ------------------------------------------------------------------------------------


def test_api_key_never_leaks(srv, make_teacher, states_factory, tmp_path, caplog, monkeypatch, capsys):
    caplog.set_level(logging.DEBUG)
    t = make_teacher("teacher-a")
    assert SECRET not in repr(t) and SECRET not in str(t.__dict__)
    with ReplayCache(tmp_path / "c.sqlite") as cache:
        res = ReplayEngine([t], cache=cache, progress=False).run(states_factory(3))
    assert not res.failures
    assert SECRET not in repr(t) and SECRET not in str(vars(t))
    assert repr(t._api_key) == f"Secret(${KEY_ENV})"
    for f in tmp_path.iterdir():
        assert SECRET.encode() not in f.read_bytes(), f.name
    # a wrong key: the server echoes the key it got in its 401 body; the error must not carry it
    monkeypatch.setenv("CP_WRONG_KEY", "sk-wrong-ALSO-SECRET-123")
    bad = make_teacher("teacher-a", api_key_env="CP_WRONG_KEY")
    with pytest.raises(TeacherCallError) as ei:
        bad.act([{"role": "user", "content": "hi"}])
    msg = str(ei.value) + repr(ei.value) + str(ei.value.__cause__) + str(ei.value.__context__)
    assert "sk-wrong-ALSO-SECRET-123" not in msg and "****" in msg and "HINT" in msg
    assert ei.value.status == 401 and not ei.value.retryable
    res = ReplayEngine([bad], progress=False).run(states_factory(1))
    assert "sk-wrong-ALSO-SECRET-123" not in res.failures[0].message
    out = capsys.readouterr()
    logs = caplog.text + out.out + out.err
    assert SECRET not in logs and "sk-wrong-ALSO-SECRET-123" not in logs


def test_missing_key_variable_names_the_variable_not_a_value(monkeypatch, make_teacher):
    monkeypatch.delenv("CP_UNSET_KEY", raising=False)
    t = make_teacher("teacher-a", api_key_env="CP_UNSET_KEY")
    with pytest.raises(TeacherError, match="CP_UNSET_KEY is not set"):
        t.act([{"role": "user", "content": "hi"}])
    with pytest.raises(TeacherError, match="NAME of an environment variable"):
        make_teacher("teacher-a", api_key_env="sk-looks-like-a-key!")
    with pytest.raises(TeacherError, match="api_key_env"):
        make_teacher("teacher-a", headers={"Authorization": "Bearer x"})


def test_request_identity_matches_state_messages(srv, make_teacher, states_factory):
    s = states_factory(1)[0]
    make_teacher("teacher-a").act(s.messages)
    assert list(srv.stats()["billed"]) == [request_identity("teacher-a", s.messages)]
    assert os.environ[KEY_ENV] == SECRET


def test_the_removed_httpx_transport_is_refused_with_the_reason():
    from composer_plugins.teachers.openai_compat import OpenAITeacher

    with pytest.raises(TeacherError, match=r"http_client must be 'aiohttp' \(the one transport\), got 'httpx'") as ei:
        OpenAITeacher("m", base_url="http://127.0.0.1:9/v1", api_key_env=None, http_client="httpx")
    assert "bench_replay" in str(ei.value) and "HINT: delete the http_client line" in str(ei.value)
    assert OpenAITeacher("m", base_url="http://127.0.0.1:9/v1", api_key_env=None).http_client == "aiohttp"
