"""Trace ingestion: recorded agent sessions → one :class:`TraceState` per student step.

Formats (``openai``, ``claude_code``) and what reaches the teachers: docs/replay.md, "Traces". Errors name the
file and line (:class:`TraceFormatError`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from composer_plugins.chat.render import content_text, render_action
from composer_plugins.core.errors import ComposerPluginsError
from composer_plugins.core.io import iter_jsonl
from composer_plugins.teachers.base import Message

TraceFormat = Literal["auto", "openai", "claude_code"]
ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
#: Message fields teachers see; everything else (thinking, reasoning, provider extras) is dropped.
VISIBLE_FIELDS = ("role", "content", "tool_calls", "tool_call_id", "name")


class TraceFormatError(ComposerPluginsError, ValueError):
    """A trace file is malformed. The message names the file and line."""

    def __init__(self, file: str | os.PathLike[str], line: int | None, message: str) -> None:
        self.file, self.line = os.fspath(file), line
        where = f"{self.file}:{line}" if line else self.file
        super().__init__(f"{where}: {message}")


@dataclass
class TraceState:
    """One student step of a recorded trace.

    ``state_id`` is ``<trace_id>#<step>``; ``messages`` the conversation up to this step as teachers see it (no
    thinking); ``student_action`` the student's assistant message (thinking kept in ``thinking``).
    """

    state_id: str
    messages: list[Message]
    student_action: Message
    trace_id: str = ""
    step: int = 0
    source: str = ""
    line: int = 0
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def student_text(self) -> str:
        """The student's action as flat text (thinking excluded)."""
        return render_action(self.student_action)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict."""
        return dict(vars(self))


def visible_message(m: Mapping[str, Any]) -> Message:
    """``m`` as a teacher may see it: only standard fields, thinking removed."""
    return {k: m[k] for k in VISIBLE_FIELDS if k in m}


def detect_format(path: str | os.PathLike[str]) -> Literal["openai", "claude_code"]:
    """Guess a trace file's format from its first non-empty line."""
    p = Path(path)
    for lineno, obj in iter_jsonl(p, objects=False, error=TraceFormatError):
        if isinstance(obj, list) or (isinstance(obj, dict) and "messages" in obj):
            return "openai"
        if isinstance(obj, dict) and ("sessionId" in obj or "uuid" in obj or obj.get("type") in ("user", "assistant")):
            return "claude_code"
        if isinstance(obj, dict) and obj.get("type") in ("summary", "system", "file-history-snapshot"):
            continue
        raise TraceFormatError(
            p,
            lineno,
            "cannot tell the trace format: expected an OpenAI {'messages': [...]} line or a Claude Code "
            "session event ({'type': 'user'|'assistant', 'message': ...}). HINT: set format: openai|claude_code",
        )
    raise TraceFormatError(p, None, "the trace file is empty")


# -- OpenAI messages JSONL --------------------------------------------------------------------


def _check_message(path: Path, lineno: int, j: int, m: Any) -> None:
    if not isinstance(m, dict):
        raise TraceFormatError(path, lineno, f"messages[{j}] must be an object, got {type(m).__name__}")
    role = m.get("role")
    if role not in ROLES:
        raise TraceFormatError(
            path, lineno, f"messages[{j}].role is {role!r}; expected one of {', '.join(sorted(ROLES))}"
        )
    c = m.get("content")
    if c is not None and not isinstance(c, str | list):
        raise TraceFormatError(path, lineno, f"messages[{j}].content must be a string, a list of parts or null")
    if role == "assistant" and c is None and not m.get("tool_calls"):
        raise TraceFormatError(path, lineno, f"messages[{j}] (assistant) has neither content nor tool_calls")
    for t, call in enumerate(m.get("tool_calls") or ()):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise TraceFormatError(path, lineno, f"messages[{j}].tool_calls[{t}] needs function.name (OpenAI shape)")


#: ``(file, line)`` of a conversation that held no student step (``line`` is ``None`` for a whole session file).
Skipped = list[tuple[str, "int | None"]]


def load_openai_jsonl(path: str | os.PathLike[str], skipped: Skipped | None = None) -> list[TraceState]:
    """States from an OpenAI-messages JSONL file (one conversation per line).

    A conversation without a student step (no assistant message after the first message) gives no
    state; its ``(file, line)`` is appended to ``skipped`` when given.
    """
    p = Path(path)
    states: list[TraceState] = []
    for lineno, obj in iter_jsonl(p, objects=False, error=TraceFormatError):
        if isinstance(obj, list):
            messages, trace_id, meta = obj, None, {}
        elif isinstance(obj, dict):
            if "messages" not in obj:
                raise TraceFormatError(p, lineno, "missing 'messages' (expected {'messages': [...]} per line)")
            messages, trace_id, meta = obj["messages"], obj.get("id"), obj.get("metadata") or {}
            if not isinstance(meta, dict):
                raise TraceFormatError(p, lineno, "'metadata' must be an object")
        else:
            raise TraceFormatError(p, lineno, f"expected an object or a list of messages, got {type(obj).__name__}")
        if not isinstance(messages, list):
            raise TraceFormatError(p, lineno, "'messages' must be a list")
        tid = str(trace_id) if trace_id is not None else f"{p.stem}:{lineno}"
        step = 0
        for j, m in enumerate(messages):
            _check_message(p, lineno, j, m)
            if m["role"] != "assistant" or j == 0:
                continue
            states.append(
                TraceState(
                    state_id=f"{tid}#{step}",
                    messages=[visible_message(x) for x in messages[:j]],
                    student_action=dict(m),
                    trace_id=tid,
                    step=step,
                    source=str(p),
                    line=lineno,
                    metadata=dict(meta),
                )
            )
            step += 1
        if step == 0 and skipped is not None:
            skipped.append((str(p), lineno))
    return states


# -- Claude Code session JSONL ----------------------------------------------------------------


def _block_text(content: Any) -> str:
    if not isinstance(content, list):
        return content_text(content)
    parts = []
    for b in content:
        if isinstance(b, dict):
            if b.get("type") == "text":
                parts.append(str(b.get("text", "")))
            elif b.get("type") == "image":
                parts.append("[image]")
        elif isinstance(b, str):
            parts.append(b)
    return "\n".join(parts)


@dataclass
class _Turn:
    msg_id: str
    line: int
    texts: list[str] = field(default_factory=list)
    thinking: list[str] = field(default_factory=list)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)

    def add(self, path: Path, lineno: int, blocks: Any) -> None:
        if isinstance(blocks, str):
            self.texts.append(blocks)
            return
        if not isinstance(blocks, list):
            raise TraceFormatError(path, lineno, "assistant message.content must be a list of blocks or a string")
        for b in blocks:
            if not isinstance(b, dict):
                raise TraceFormatError(path, lineno, "assistant content blocks must be objects")
            t = b.get("type")
            if t == "text" and b.get("text"):
                self.texts.append(str(b["text"]))
            elif t == "thinking" and b.get("thinking"):
                self.thinking.append(str(b["thinking"]))
            elif t in ("tool_use", "server_tool_use"):
                if not isinstance(b.get("name"), str):
                    raise TraceFormatError(path, lineno, f"{t} block without a 'name'")
                args = b.get("input", {})
                self.tool_calls.append(
                    {
                        "id": str(b.get("id", f"call_{len(self.tool_calls)}")),
                        "type": "function",
                        "function": {"name": b["name"], "arguments": json.dumps(args, ensure_ascii=False)},
                    }
                )
            # redacted_thinking and unknown block types carry nothing a teacher can compare

    def visible(self) -> Message:
        m: Message = {"role": "assistant", "content": "\n".join(self.texts) if self.texts else None}
        if self.tool_calls:
            m["tool_calls"] = self.tool_calls
        return m

    def action(self) -> Message:
        m = self.visible()
        if self.thinking:
            m["thinking"] = "\n".join(self.thinking)
        return m


def _user_messages(path: Path, lineno: int, content: Any) -> list[Message]:
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise TraceFormatError(path, lineno, "user message.content must be a string or a list of blocks")
    out: list[Message] = []
    texts: list[str] = []
    for b in content:
        if not isinstance(b, dict):
            raise TraceFormatError(path, lineno, "user content blocks must be objects")
        t = b.get("type")
        if t == "tool_result":
            if "tool_use_id" not in b:
                raise TraceFormatError(path, lineno, "tool_result block without 'tool_use_id'")
            body = _block_text(b.get("content"))
            if b.get("is_error"):
                body = "[error] " + body
            out.append({"role": "tool", "tool_call_id": str(b["tool_use_id"]), "content": body})
        elif t in ("text", "image"):
            texts.append(_block_text([b]))
    if texts:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def load_claude_code_jsonl(path: str | os.PathLike[str], skipped: Skipped | None = None) -> list[TraceState]:
    """States from a Claude Code session log (one event per line); a log with none is appended to ``skipped``."""
    p = Path(path)
    history: list[Message] = []
    states: list[TraceState] = []
    turn: _Turn | None = None
    session: str | None = None
    steps: dict[str, int] = {}

    def close() -> None:
        nonlocal turn
        t, turn = turn, None
        if t is None or (not t.texts and not t.tool_calls):  # nothing the student said or did
            return
        tid = session or p.stem
        step = steps.get(tid, 0)
        if history:
            states.append(
                TraceState(
                    state_id=f"{tid}#{step}",
                    messages=list(history),
                    student_action=t.action(),
                    trace_id=tid,
                    step=step,
                    source=str(p),
                    line=t.line,
                )
            )
            steps[tid] = step + 1
        history.append(t.visible())

    for lineno, ev in iter_jsonl(p, objects=False, error=TraceFormatError):
        if not isinstance(ev, dict):
            raise TraceFormatError(p, lineno, f"expected a session event object, got {type(ev).__name__}")
        kind = ev.get("type")
        if kind not in ("user", "assistant"):
            continue  # summaries, system notices, file snapshots ...
        if ev.get("isSidechain") or ev.get("isMeta"):
            continue  # subagent turns and injected meta messages are not the student's main line
        msg = ev.get("message")
        if not isinstance(msg, dict) or "content" not in msg:
            raise TraceFormatError(p, lineno, f"{kind} event without a 'message' object with 'content'")
        if ev.get("sessionId"):
            session = str(ev["sessionId"])
        if kind == "assistant":
            mid = str(msg.get("id") or ev.get("uuid") or f"line{lineno}")
            if turn is None or turn.msg_id != mid:
                close()
                turn = _Turn(mid, lineno)
            turn.add(p, lineno, msg["content"])
        else:
            close()
            history.extend(_user_messages(p, lineno, msg["content"]))
    close()
    if not states and skipped is not None:
        skipped.append((str(p), None))
    return states


# -- entry point -------------------------------------------------------------------------------

_LOADERS = {"openai": load_openai_jsonl, "claude_code": load_claude_code_jsonl}


def load_traces(
    paths: str | os.PathLike[str] | Iterable[str | os.PathLike[str] | Mapping[str, Any]],
    format: TraceFormat = "auto",
    limit: int | None = None,
    skipped: Skipped | None = None,
) -> list[TraceState]:
    """All states of ``paths`` (files, directories of ``*.jsonl``, or ``{"path":, "format":}`` entries).

    State ids must be unique across files; a duplicate raises, naming both places. Conversations that
    hold no student step are appended to ``skipped`` as ``(file, line)`` when it is given.
    """
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    entries: list[tuple[Path, str]] = []
    for entry in paths:
        if isinstance(entry, Mapping):
            p, fmt = Path(entry["path"]), str(entry.get("format", format))
        else:
            p, fmt = Path(entry), format
        if p.is_dir():
            entries.extend((f, fmt) for f in sorted(p.glob("*.jsonl")))
        else:
            entries.append((p, fmt))
    seen: dict[str, TraceState] = {}  # in reading order
    for p, fmt in entries:
        load = _LOADERS.get(detect_format(p) if fmt == "auto" else fmt)
        if load is None:
            raise TraceFormatError(p, None, f"unknown trace format {fmt!r}; use auto, openai or claude_code")
        for s in load(p, skipped):
            if s.state_id in seen:
                o = seen[s.state_id]
                raise TraceFormatError(
                    p,
                    s.line,
                    f"state id {s.state_id!r} was already read from {o.source}:{o.line}. "
                    "HINT: give each conversation a distinct 'id' (or do not list a file twice)",
                )
            seen[s.state_id] = s
            if limit is not None and len(seen) >= limit:
                return list(seen.values())
    return list(seen.values())
