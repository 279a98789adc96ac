"""The teacher context: the student's context with the hint inserted at the failing turn."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


def _insert_before_cue(text: str, block: str) -> str:
    """Put ``block`` before a final answer cue line (``Answer:``), else at the end."""
    stripped = text.rstrip()
    head, sep, last = stripped.rpartition("\n")
    if sep and len(last) <= 24 and last.rstrip().endswith(":"):
        return f"{head}\n{block}\n{last}{text[len(stripped) :]}"
    return f"{stripped}\n\n{block}"


def build_teacher_context(
    prompt: str | Sequence[Mapping[str, Any]],
    hint: str | None,
    *,
    failing_turn: int | None = None,
    template: str = "Hint: {hint}",
    role: str = "user",
) -> str | list[dict[str, Any]]:
    """The teacher context: the student's context with the hint inserted at the failing turn.

    Where the hint goes, for a text prompt and for chat messages: docs/envs.md, "Hints". ``failing_turn`` is an
    index into ``messages`` (default: the last assistant message, or the next turn if the last message is not
    the assistant's); a new hint message gets ``role``. With ``hint`` None or empty the context is unchanged.
    """
    if isinstance(prompt, str):
        if not hint:
            return prompt
        return _insert_before_cue(prompt, template.format(hint=hint))
    messages = [dict(m) for m in prompt]
    if failing_turn is None:
        failing_turn = len(messages) - 1 if messages and messages[-1].get("role") == "assistant" else len(messages)
    if not 0 <= failing_turn <= len(messages):
        raise IndexError(f"failing_turn {failing_turn} is outside the conversation (0..{len(messages)})")
    if failing_turn < len(messages) and messages[failing_turn].get("role") != "assistant":
        raise ValueError(
            f"message {failing_turn} is a {messages[failing_turn].get('role')!r} turn, not the assistant's"
        )
    ctx = messages[:failing_turn]
    if not hint:
        return ctx
    block = template.format(hint=hint)
    if ctx and ctx[-1].get("role") in ("user", "tool") and isinstance(ctx[-1].get("content"), str):
        ctx[-1]["content"] = f"{ctx[-1]['content'].rstrip()}\n\n{block}"
    else:
        ctx.append({"role": role, "content": block})
    return ctx
