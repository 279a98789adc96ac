"""Pair extraction, action normalisation, the oracle, the budget, retry policy and the cache."""

from __future__ import annotations

import json
import random
import time

import pytest

from composer_plugins.chat.render import render_action
from composer_plugins.teachers.base import TeacherCallError, TeacherResponse, estimate_prompt_tokens
from composer_plugins.teachers.budget import Budget
from composer_plugins.teachers.cache import ReplayCache, cache_key
from composer_plugins.teachers.engine import RetryPolicy
from composer_plugins.teachers.openai_compat import parse_retry_after
from composer_plugins.teachers.oracle import OracleTeacher, solve_arithmetic
from composer_plugins.teachers.pairs import (
    PAIR_FIELDS,
    consensus,
    extract_pairs,
    final_answer,
    normalize_action,
    validate_pair,
)
from composer_plugins.teachers.traces import TraceState


def _call(name: str, args: str, cid: str = "c1") -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def test_normalize_action_canonicalises_tool_json_and_whitespace():
    a = {
        "role": "assistant",
        "content": "  Let me\n\n search ",
        "tool_calls": [_call("search", '{"q": "cats", "n": 3}')],
    }
    b = {
        "role": "assistant",
        "content": "Let me search",
        "tool_calls": [_call("search", '{\n "n": 3,\n "q": "cats"\n}', "x")],
    }
    c = {"role": "assistant", "content": "Let me search", "tool_calls": [_call("search", '{"q": "dogs", "n": 3}')]}
    assert normalize_action(a) == normalize_action(b) != normalize_action(c)
    # JSON written as text content is canonicalised too; thinking never counts
    assert normalize_action('{"b": 1, "a": [1, 2]}') == normalize_action('{ "a": [1,2], "b": 1 }')
    assert normalize_action({"content": "x", "thinking": "long"}) == normalize_action({"content": "x"})
    assert normalize_action({"content": None, "tool_calls": [_call("f", "not json  here")]}) == "f(not json here)"


def test_final_answer_mode():
    assert final_answer("so 3 + 4 = 7\n#### 7") == "7"
    assert final_answer("The answer is \\boxed{1,234}.") == "1234"
    assert final_answer("maybe 3, maybe 4.0") == "4"
    assert normalize_action("work... #### 12", "final_answer") == normalize_action("It is 12", "final_answer")
    with pytest.raises(ValueError):
        normalize_action("x", "fuzzy")  # type: ignore[arg-type]


def test_consensus_rules():
    keys = {"a": "x", "b": "x", "c": "y"}
    assert consensus(keys, 2) == ("x", ["a", "b"])
    assert consensus(keys, 3) is None
    assert consensus({"a": "x", "b": "y"}, 1) == "tie"
    assert consensus({"a": "x", "b": "x", "c": "y", "d": "y"}, 2) == "tie"
    assert consensus(keys, 2, order=["b", "a", "c"]) == ("x", ["b", "a"])


def _resp(tid: str, text: str) -> TeacherResponse:
    return TeacherResponse(text=text, message={"role": "assistant", "content": text}, teacher=tid)


def test_extract_pairs_provenance_and_stats():
    states = [
        TraceState(
            "s#0",
            [{"role": "user", "content": "2+2?"}],
            {"role": "assistant", "content": "#### 5", "thinking": "hmm"},
            trace_id="s",
            source="t.jsonl",
            line=3,
            metadata={"answer": "4"},
        ),
        TraceState("s#1", [{"role": "user", "content": "3+3?"}], {"role": "assistant", "content": "####  6"}),
        TraceState("s#2", [{"role": "user", "content": "q"}], {"role": "assistant", "content": "a"}),
        TraceState("s#3", [{"role": "user", "content": "q2"}], {"role": "assistant", "content": "a"}),
    ]
    responses = {
        "s#0": {"t1": _resp("t1", "#### 4"), "t2": _resp("t2", "####   4 "), "t3": _resp("t3", "#### 3")},
        "s#1": {"t1": _resp("t1", "#### 6"), "t2": _resp("t2", "#### 6")},
        "s#2": {"t1": _resp("t1", "x"), "t2": _resp("t2", "x"), "t3": _resp("t3", "y"), "t4": _resp("t4", "y")},
        "s#3": {"t1": _resp("t1", "x")},
    }
    pairs, stats = extract_pairs(states, responses, k=2, teacher_order=["t2", "t1", "t3"])
    assert stats.to_dict() == {
        "states": 4,
        "pairs": 1,
        "student_agrees": 1,
        "no_consensus": 0,
        "ties": 1,
        "too_few_answers": 1,
    }
    (p,) = pairs
    assert set(PAIR_FIELDS) <= set(p) and validate_pair(p) == []
    assert p["chosen"] == "####   4 "  # as the first agreeing teacher (in teacher_order) wrote it
    assert p["teachers"] == ["t2", "t1"] and p["k"] == 2 and p["n_teachers"] == 3
    assert p["agreement"] == pytest.approx(2 / 3, abs=1e-6)
    assert p["rejected"] == "#### 5" and p["rejected_message"]["thinking"] == "hmm"
    assert p["dissent"] == {"t3": "#### 3"} and p["source"] == "t.jsonl:3" and p["metadata"] == {"answer": "4"}
    assert p["prompt"] == "2+2?" and p["messages"] == [{"role": "user", "content": "2+2?"}]
    json.dumps(p)  # JSON-able
    assert validate_pair({"prompt": 1}) != []


def test_render_action_and_prompt_estimate():
    msg = {"role": "assistant", "content": "hi", "tool_calls": [_call("f", '{"a":1}')]}
    assert render_action(msg) == 'hi\n{"tool": "f", "arguments": "{\\"a\\":1}"}'
    msgs = [{"role": "user", "content": "héllo wörld " * 10}]
    # byte-level BPE: never more tokens than UTF-8 bytes (+ overheads)
    assert estimate_prompt_tokens(msgs) >= len(msgs[0]["content"].encode())


def test_oracle_solves_and_abstains():
    assert solve_arithmetic("Tom has 3 boxes of 12 eggs. What is 3 * 12 + 4?") == "40"
    assert solve_arithmetic("What is 7 divided by 2?") == "3.5"
    assert solve_arithmetic("What is 1,200 plus 35?") == "1235"
    assert solve_arithmetic("No numbers here") is None
    o = OracleTeacher()
    assert o.act([{"role": "user", "content": "What is (2 + 3) * 4?"}]).text == "#### 20"
    # ground truth from the trace metadata wins
    assert o.act([{"role": "user", "content": "hard word problem"}], metadata={"answer": "17"}).text == "#### 17"
    with pytest.raises(TeacherCallError, match="abstains"):
        o.act([{"role": "user", "content": "Write a poem"}])
    custom = OracleTeacher(solver=lambda msgs, meta: len(msgs), template="ANSWER: {answer}")
    assert custom.act([{"role": "user", "content": "x"}]).text == "ANSWER: 1"
    by_path = OracleTeacher(solver="composer_plugins.teachers.oracle:solve_arithmetic")
    assert by_path.solver is solve_arithmetic


def test_budget_invariant_under_random_sequences():
    rng = random.Random(0)
    for _ in range(50):
        b = Budget(max_usd=1.0)
        held: list[float] = []
        for _ in range(200):
            if held and rng.random() < 0.5:
                r = held.pop(rng.randrange(len(held)))
                choice = rng.random()
                if choice < 0.6:
                    b.settle(r, r * rng.random())
                elif choice < 0.8:
                    b.release(r)
                else:
                    b.mark_uncertain(r)
            else:
                amt = rng.random() * 0.2
                if b.try_reserve(amt):
                    held.append(amt)
            assert b.committed_usd <= 1.0 + 1e-9
            assert b.in_flight == len(held)
        assert b.spent_usd + b.uncertain_usd <= 1.0 + 1e-9


def test_retry_policy_and_retry_after():
    p = RetryPolicy(backoff_base_s=0.5, backoff_max_s=4.0)
    rng = random.Random(1)
    for n in range(8):
        d = p.delay(n, None, rng)
        cap = min(4.0, 0.5 * 2**n)
        assert cap / 2 <= d <= cap
    assert p.delay(0, 7.0, rng) >= 7.0
    assert RetryPolicy(retry_after_max_s=10).delay(0, 1e6, rng) <= 10.0
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after("0.5") == 0.5
    date = time.strftime("%a, %d %b %Y %H:%M:%S GMT", time.gmtime(time.time() + 30))
    assert 25 <= parse_retry_after(date) <= 31
    assert parse_retry_after("soon") is None and parse_retry_after(None) is None


def test_cache_roundtrip_keys_and_durability(tmp_path):
    k1 = cache_key("t", "openai", "m", {"temperature": 0, "max_tokens": 8}, [{"role": "user", "content": "x"}])
    k2 = cache_key("t", "openai", "m", {"max_tokens": 8, "temperature": 0}, [{"content": "x", "role": "user"}])
    k3 = cache_key("t", "openai", "m", {"max_tokens": 9, "temperature": 0}, [{"role": "user", "content": "x"}])
    assert k1 == k2 != k3
    path = tmp_path / "sub" / "c.sqlite"
    with ReplayCache(path) as c:
        c.put(k1, "t", "m", {"text": "hi", "message": {"role": "assistant", "content": "hi"}})
        assert k1 in c and c.get(k3) is None
    # a second connection (another process after a crash) sees the committed row
    with ReplayCache(path) as c:
        assert c.get(k1)["text"] == "hi" and len(c) == 1
        assert c.get_many([k1, k3]) == {k1: c.get(k1)}
        with c.run_lock("r"), ReplayCache(path) as other:
            with pytest.raises(Exception, match="another replay process"):
                with other.run_lock("r"):
                    pass


def test_responses_table_lists_teachers_by_id_whichever_answered_first():
    """The replay stage's responses.jsonl is a DVC output: its bytes must not follow the teachers' finishing order."""
    from composer_plugins.teachers.engine import ReplayResult, ReplayStats, responses_table

    def answers(order):
        return {t: TeacherResponse(f"#### {t}", {"role": "assistant", "content": t}, teacher=t) for t in order}

    rows = [
        responses_table(ReplayResult({"s#0": answers(order)}, [], ReplayStats(), ["b", "a", "c"]))
        for order in (["c", "a", "b"], ["b", "c", "a"])
    ]
    assert rows[0] == rows[1] == [{"state_id": "s#0", "teachers": {"a": "#### a", "b": "#### b", "c": "#### c"}}]
    assert [json.dumps(r) for r in rows[0]] == [json.dumps(r) for r in rows[1]]  # the same bytes, key order included
