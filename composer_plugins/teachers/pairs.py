"""Preference pairs from teacher agreement.

The consensus rule and the pair record's fields: docs/replay.md, "Pairs".
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal

from composer_plugins.chat.render import content_text, plain_prompt, render_action
from composer_plugins.teachers.base import TeacherResponse
from composer_plugins.teachers.traces import TraceState

Compare = Literal["text", "final_answer"]
PAIR_FIELDS = tuple(
    "state_id trace_id step source prompt messages chosen rejected chosen_message rejected_message teachers k "
    "n_teachers agreement dissent compare metadata".split()
)

_WS = re.compile(r"\s+")
_NUM = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def canonical_json(obj: Any) -> str:
    """Compact JSON with sorted keys (the canonical form of tool arguments)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def normalize_whitespace(text: str) -> str:
    """Strip and collapse every whitespace run to one space."""
    return _WS.sub(" ", text).strip()


def _maybe_json(text: str) -> str | None:
    s = text.strip()
    if s[:1] in ("{", "[") and s[-1:] in ("}", "]"):
        try:
            return canonical_json(json.loads(s))
        except json.JSONDecodeError:
            return None
    return None


def _normalize_content(content: Any) -> str:
    text = content_text(content)
    return _maybe_json(text) or normalize_whitespace(text)


def _normalize_call(call: Mapping[str, Any]) -> str:
    fn = call.get("function", call)
    name = str(fn.get("name", "")).strip()
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args_c = canonical_json(json.loads(args)) if args.strip() else "{}"
        except json.JSONDecodeError:
            args_c = normalize_whitespace(args)
    else:
        args_c = canonical_json(args)
    return f"{name}({args_c})"


def final_answer(text: str) -> str | None:
    """The final answer of a solution: after the last ``####``, in ``\\boxed{}``, or the last number."""
    if "####" in text:
        tail = text.rsplit("####", 1)[1]
        m = _NUM.search(tail)
        return _num(m.group(0)) if m else normalize_whitespace(tail) or None
    boxed = re.findall(r"\\boxed\{([^{}]*)\}", text)
    if boxed:
        m = _NUM.search(boxed[-1])
        return _num(m.group(0)) if m else normalize_whitespace(boxed[-1])
    nums = _NUM.findall(text)
    return _num(nums[-1]) if nums else None


def _num(s: str) -> str:
    s = s.replace(",", "")
    try:
        f = float(s)
    except ValueError:
        return s
    return str(int(f)) if f.is_integer() else repr(f)


def normalize_action(action: Mapping[str, Any] | str | None, compare: Compare = "text") -> str:
    """The comparison key of an action (docs/replay.md, "Pairs"); ``final_answer`` falls back to ``text`` when
    there is no final answer."""
    if action is None:
        return ""
    msg: Mapping[str, Any] = {"content": action} if isinstance(action, str) else action
    if compare == "final_answer":
        ans = final_answer(render_action({"content": msg.get("content")}))
        if ans is not None and not msg.get("tool_calls"):
            return f"answer:{ans}"
    elif compare != "text":
        raise ValueError(f"compare must be 'text' or 'final_answer', got {compare!r}")
    parts = [_normalize_content(msg.get("content"))]
    parts += [_normalize_call(c) for c in msg.get("tool_calls") or () if isinstance(c, Mapping)]
    return "\n".join(p for p in parts if p)


@dataclass
class PairStats:
    """What happened to each state during pair extraction."""

    states: int = 0
    pairs: int = 0
    student_agrees: int = 0
    no_consensus: int = 0
    ties: int = 0
    too_few_answers: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def consensus(
    keys: Mapping[str, str], k: int, order: Sequence[str] | None = None
) -> tuple[str, list[str]] | Literal["tie"] | None:
    """The action key at least ``k`` teachers share and that has strictly the most support.

    Returns ``(key, agreeing teacher ids in order)``, ``"tie"`` when two groups share the
    maximum, or ``None`` when no group reaches ``k``.
    """
    order = list(order) if order is not None else []
    order += [tid for tid in keys if tid not in order]
    groups: dict[str, list[str]] = {}
    for tid in order:
        if tid in keys:
            groups.setdefault(keys[tid], []).append(tid)
    if not groups:
        return None
    best = max(len(v) for v in groups.values())
    if best < k:
        return None
    top = [key for key, v in groups.items() if len(v) == best]
    if len(top) > 1:
        return "tie"
    return top[0], groups[top[0]]


def extract_pairs(
    states: Sequence[TraceState],
    responses: Mapping[str, Mapping[str, TeacherResponse]],
    *,
    k: int = 2,
    compare: Compare = "text",
    teacher_order: Sequence[str] | None = None,
) -> tuple[list[dict[str, Any]], PairStats]:
    """Pairs (chosen = consensus of >= ``k`` teachers, rejected = student) where the student disagrees.

    ``responses``: ``{state_id: {teacher_id: TeacherResponse}}``; ``teacher_order``: the preference order for
    picking the chosen text (default: answer order).
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    stats = PairStats()
    pairs: list[dict[str, Any]] = []
    for s in states:
        stats.states += 1
        answers = responses.get(s.state_id, {})
        if len(answers) < k:
            stats.too_few_answers += 1
            continue
        keys = {tid: normalize_action(r.message, compare) for tid, r in answers.items()}
        c = consensus(keys, k, teacher_order if teacher_order is not None else list(answers))
        if c is None:
            stats.no_consensus += 1
            continue
        if c == "tie":
            stats.ties += 1
            continue
        key, agreeing = c
        if normalize_action(s.student_action, compare) == key:
            stats.student_agrees += 1
            continue
        best = answers[agreeing[0]]
        pairs.append(
            {
                "state_id": s.state_id,
                "trace_id": s.trace_id,
                "step": s.step,
                "source": f"{s.source}:{s.line}" if s.source else "",
                "prompt": plain_prompt(s.messages),
                "messages": s.messages,
                "chosen": best.text,
                "rejected": s.student_text,
                "chosen_message": best.message,
                "rejected_message": s.student_action,
                "teachers": agreeing,
                "k": k,
                "n_teachers": len(answers),
                "agreement": round(len(agreeing) / len(answers), 6),
                "dissent": {tid: r.text for tid, r in answers.items() if tid not in agreeing},
                "compare": compare,
                "metadata": s.metadata,
            }
        )
        stats.pairs += 1
    return pairs, stats


def validate_pair(record: Mapping[str, Any]) -> list[str]:
    """Problems with a pair record (empty when it matches the schema)."""
    problems = [f"missing field {f!r}" for f in PAIR_FIELDS if f not in record]
    for f in ("prompt", "chosen", "rejected", "state_id"):
        if f in record and not isinstance(record[f], str):
            problems.append(f"{f} must be a string")
    if "messages" in record and not isinstance(record["messages"], list):
        problems.append("messages must be a list")
    if "teachers" in record and not isinstance(record["teachers"], list):
        problems.append("teachers must be a list")
    return problems
