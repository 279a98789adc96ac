"""Trace ingestion: OpenAI-messages JSONL and Claude Code session JSONL → TraceState per student step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from composer_plugins.teachers.traces import TraceFormatError, detect_format, load_traces


def _write(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def claude_session(session: str = "sess-1") -> list[dict]:
    """A Claude Code session log: split assistant lines, thinking, tool use, a sidechain, a summary."""
    base = {"sessionId": session, "isSidechain": False, "userType": "external", "cwd": "/repo", "version": "1.0.0"}
    return [
        {"type": "summary", "summary": "Fix the failing test", "leafUuid": "x"},
        {
            **base,
            "type": "user",
            "uuid": "u1",
            "parentUuid": None,
            "message": {"role": "user", "content": "The test in test_math.py fails. Fix it."},
        },
        # one API message written as three lines (thinking, text, tool_use) sharing message.id
        {
            **base,
            "type": "assistant",
            "uuid": "a1",
            "parentUuid": "u1",
            "requestId": "req_1",
            "message": {
                "id": "msg_1",
                "role": "assistant",
                "model": "claude-x",
                "content": [{"type": "thinking", "thinking": "I should read the file first.", "signature": "s"}],
            },
        },
        {
            **base,
            "type": "assistant",
            "uuid": "a2",
            "parentUuid": "a1",
            "requestId": "req_1",
            "message": {"id": "msg_1", "role": "assistant", "content": [{"type": "text", "text": "Let me look."}]},
        },
        {
            **base,
            "type": "assistant",
            "uuid": "a3",
            "parentUuid": "a2",
            "requestId": "req_1",
            "message": {
                "id": "msg_1",
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "toolu_1", "name": "Read", "input": {"file_path": "/repo/test_math.py"}}
                ],
            },
        },
        {
            **base,
            "type": "user",
            "uuid": "u2",
            "parentUuid": "a3",
            "message": {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "assert 1+1 == 3"}],
                    }
                ],
            },
            "toolUseResult": {"stdout": "..."},
        },
        # a subagent (sidechain) exchange: skipped entirely
        {
            **base,
            "isSidechain": True,
            "type": "user",
            "uuid": "s1",
            "parentUuid": "u2",
            "message": {"role": "user", "content": "subagent task"},
        },
        {
            **base,
            "isSidechain": True,
            "type": "assistant",
            "uuid": "s2",
            "parentUuid": "s1",
            "message": {
                "id": "msg_side",
                "role": "assistant",
                "content": [{"type": "text", "text": "subagent answer"}],
            },
        },
        # injected meta message: skipped
        {
            **base,
            "isMeta": True,
            "type": "user",
            "uuid": "m1",
            "parentUuid": "u2",
            "message": {"role": "user", "content": "<command-name>/clear</command-name>"},
        },
        {
            **base,
            "type": "assistant",
            "uuid": "a4",
            "parentUuid": "u2",
            "message": {
                "id": "msg_2",
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "The expected value is wrong."},
                    {
                        "type": "tool_use",
                        "id": "toolu_2",
                        "name": "Edit",
                        "input": {"file_path": "/repo/test_math.py", "old_string": "3", "new_string": "2"},
                    },
                ],
            },
        },
        {
            **base,
            "type": "user",
            "uuid": "u3",
            "parentUuid": "a4",
            "message": {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_2", "content": "ok", "is_error": False}],
            },
        },
        {
            **base,
            "type": "assistant",
            "uuid": "a5",
            "parentUuid": "u3",
            "message": {
                "id": "msg_3",
                "role": "assistant",
                "content": [{"type": "text", "text": "Fixed the assertion."}],
            },
        },
    ]


def test_claude_code_session(tmp_path):
    p = _write(tmp_path / "session.jsonl", claude_session())
    assert detect_format(p) == "claude_code"
    states = load_traces(p)
    assert [s.state_id for s in states] == ["sess-1#0", "sess-1#1", "sess-1#2"]
    s0, s1, s2 = states
    # the three lines of msg_1 are one turn; thinking kept in the action, hidden from teachers
    assert s0.messages == [{"role": "user", "content": "The test in test_math.py fails. Fix it."}]
    assert s0.student_action["content"] == "Let me look."
    assert s0.student_action["thinking"] == "I should read the file first."
    call = s0.student_action["tool_calls"][0]
    assert call["function"]["name"] == "Read" and json.loads(call["function"]["arguments"]) == {
        "file_path": "/repo/test_math.py"
    }
    assert s0.line == 3  # the first line of the turn
    # history: assistant turn without thinking, tool result as an OpenAI tool message
    assert s1.messages[1] == {"role": "assistant", "content": "Let me look.", "tool_calls": [call]}
    assert s1.messages[2] == {"role": "tool", "tool_call_id": "toolu_1", "content": "assert 1+1 == 3"}
    assert s1.student_action["content"] is None and s1.student_action["thinking"] == "The expected value is wrong."
    assert s2.student_text == "Fixed the assertion."
    everything = json.dumps([s.messages for s in states])
    assert "subagent" not in everything and "/clear" not in everything
    assert "read the file first" not in everything and "expected value is wrong" not in everything
    assert "thinking" not in s2.student_text


def test_openai_messages_jsonl(tmp_path):
    rows = [
        {
            "id": "c1",
            "metadata": {"answer": "5"},
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "2+3?"},
                {"role": "assistant", "content": "#### 5", "reasoning_content": "2 plus 3"},
                {"role": "user", "content": "and times 2?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "calc", "arguments": '{"x": 10}'}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c", "content": "10"},
                {"role": "assistant", "content": "#### 10"},
            ],
        },
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
    ]
    p = _write(tmp_path / "conv.jsonl", rows)
    assert detect_format(p) == "openai"
    states = load_traces(p)
    assert [s.state_id for s in states] == ["c1#0", "c1#1", "c1#2", "conv:2#0"]
    assert states[0].metadata == {"answer": "5"} and states[0].line == 1
    assert states[0].student_action["reasoning_content"] == "2 plus 3"  # kept in the action
    assert "reasoning_content" not in states[1].messages[2]  # hidden from teachers
    assert states[2].messages[-1]["role"] == "tool"
    assert states[3].line == 2


@pytest.mark.parametrize(
    "line, match",
    [
        ("{not json", r"conv.jsonl:2: invalid JSON"),
        (json.dumps({"messages": [{"role": "robot", "content": "x"}]}), r"conv.jsonl:2: messages\[0\].role"),
        (json.dumps({"messages": [{"role": "user", "content": "x"}, {"role": "assistant"}]}), "neither content"),
        (json.dumps({"msgs": []}), r"conv.jsonl:2: missing 'messages'"),
        (json.dumps({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"x": 1}]}]}), "function.name"),
    ],
)
def test_errors_name_file_and_line(tmp_path, line, match):
    good = json.dumps({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]})
    p = tmp_path / "conv.jsonl"
    p.write_text(good + "\n" + line + "\n")
    with pytest.raises(TraceFormatError, match=match):
        load_traces(p, format="openai")


def test_claude_code_errors_name_file_and_line(tmp_path):
    rows = claude_session()
    rows[3] = {"type": "assistant", "sessionId": "s", "message": {"role": "assistant"}}
    p = _write(tmp_path / "s.jsonl", rows)
    with pytest.raises(TraceFormatError, match=r"s.jsonl:4: assistant event without a 'message'"):
        load_traces(p)


def test_duplicate_state_ids_and_unknown_format(tmp_path):
    p = _write(
        tmp_path / "a.jsonl",
        [{"id": "x", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}],
    )
    q = tmp_path / "b.jsonl"
    q.write_text(p.read_text())
    with pytest.raises(TraceFormatError, match=r"already read from .*a.jsonl:1"):
        load_traces([p, q])
    with pytest.raises(TraceFormatError, match="cannot tell the trace format"):
        load_traces(_write(tmp_path / "c.jsonl", [{"foo": 1}]))
    assert len(load_traces(tmp_path / "a.jsonl", limit=1)) == 1
    assert len(load_traces([{"path": str(p), "format": "openai"}])) == 1


def test_states_cli(tmp_path):
    from composer_plugins.core.cli import load_commands

    p = _write(tmp_path / "session.jsonl", claude_session())
    res = CliRunner().invoke(load_commands(), ["replay", "states", str(p)])
    assert res.exit_code == 0, res.output
    assert "3 student steps in 1 trace(s)" in res.output
    res = CliRunner().invoke(load_commands(), ["replay", "states", "--jsonl", str(p)])
    assert [json.loads(x)["state_id"] for x in res.output.splitlines()] == ["sess-1#0", "sess-1#1", "sess-1#2"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [}\n')
    res = CliRunner().invoke(load_commands(), ["replay", "states", "--format", "openai", str(bad)])
    assert res.exit_code == 2 and "bad.jsonl:1" in res.output
