"""The one renderer of a prompt into the text a model reads: chat messages through a chat template.

A prompt is either text (used exactly as it is) or a conversation, a list of ``{role, content}`` messages.
:func:`render_prompt` turns a conversation into text for one tokenizer with ``template="auto"`` (the
tokenizer's own chat template with the generation prompt; without one, :func:`plain_prompt`), ``"none"``
(:func:`plain_prompt`: a lone user message verbatim, longer conversations with ``<|role|>`` headers) or the
path of a Jinja chat-template file. It lives here, below every package that feeds a model (the training loop
and its backends, the teachers with their own tokenizer), so there is one implementation; the tokenizer is
duck-typed (``chat_template`` and ``apply_chat_template``), nothing is imported.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "CHAT_MODES",
    "content_text",
    "is_conversation",
    "plain_prompt",
    "read_chat_template",
    "render_action",
    "render_messages",
    "render_prompt",
]

#: The named values of ``model.chat_template`` (anything else is a path to a Jinja file).
CHAT_MODES = ("auto", "none")


def is_conversation(prompt: Any) -> bool:
    """True for a list of chat messages (mappings with a ``role``), False for text."""
    return (
        not isinstance(prompt, str | bytes)
        and isinstance(prompt, Sequence)
        and len(prompt) > 0
        and all(isinstance(m, Mapping) and "role" in m for m in prompt)
    )


def content_text(content: Any) -> str:
    """A message's content as text (a list of parts: their ``text`` joined by newlines; ``None``: empty)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping) and "text" in p)
    return str(content)


def render_action(message: Mapping[str, Any] | str | None) -> str:
    """Flat text of an assistant action: its content, then each tool call as a JSON line.

    Thinking (``thinking`` / ``reasoning_content``) is not part of the rendered action.
    """
    if message is None:
        return ""
    if isinstance(message, str):
        return message
    parts: list[str] = []
    content = message.get("content")
    if isinstance(content, str) and content:
        parts.append(content)
    elif isinstance(content, list):  # content parts
        parts.extend(str(p.get("text", "")) for p in content if isinstance(p, Mapping) and p.get("text"))
    for call in message.get("tool_calls") or ():
        fn = call.get("function", call) if isinstance(call, Mapping) else {}
        args = fn.get("arguments", "")
        if not isinstance(args, str):
            args = json.dumps(args, ensure_ascii=False)
        parts.append(json.dumps({"tool": fn.get("name", ""), "arguments": args}, ensure_ascii=False))
    return "\n".join(parts)


def render_messages(messages: Sequence[Mapping[str, Any]]) -> str:
    """Flat text of a conversation: ``<|role|>`` headers followed by each message's text (an assistant
    message: :func:`render_action`; a tool result: ``<|tool:<call id>|>``)."""
    chunks = []
    for m in messages:
        role = str(m.get("role", "user"))
        body = render_action(m) if role == "assistant" else content_text(m.get("content"))
        if role == "tool" and m.get("tool_call_id"):
            role = f"tool:{m['tool_call_id']}"
        chunks.append(f"<|{role}|>\n{body}")
    return "\n".join(chunks)


def plain_prompt(messages: Sequence[Mapping[str, Any]]) -> str:
    """A conversation as text without a chat template: the one prompt renderer (policies, teachers, pairs).

    A lone user message is its content, unchanged (what a text-prompted policy reads); anything
    longer is :func:`render_messages` followed by an ``<|assistant|>`` header.
    """
    if len(messages) == 1 and messages[0].get("role") == "user":
        return content_text(messages[0].get("content"))
    return render_messages(messages) + "\n<|assistant|>\n"


@functools.lru_cache(maxsize=16)
def _read(path: str, mtime: float) -> str:
    with open(path, encoding="utf-8") as f:
        return f.read()


def read_chat_template(path: str | os.PathLike[str]) -> str:
    """The text of a Jinja chat-template file (cached until the file changes)."""
    p = os.fspath(path)
    return _read(p, os.path.getmtime(p))


def render_prompt(prompt: Any, tokenizer: Any = None, template: str = "auto") -> str:
    """The text a model with ``tokenizer`` reads for ``prompt`` (text, or a list of chat messages).

    Text is returned unchanged whatever ``template`` says. A conversation is rendered with
    ``template`` (``auto``, ``none`` or the path of a Jinja file, see the module docstring), the
    generation prompt added, as text: tokenize it with ``add_special_tokens=False`` (the template
    writes its own special tokens).
    """
    if isinstance(prompt, str):
        return prompt
    if not is_conversation(prompt):
        raise TypeError(
            "a prompt is text or a list of chat messages ({'role': ..., 'content': ...}), "
            f"got {type(prompt).__name__}: {str(prompt)[:80]!r}"
        )
    messages = [dict(m) for m in prompt]
    if template == "none" or tokenizer is None:
        return plain_prompt(messages)
    if template == "auto" and not getattr(tokenizer, "chat_template", None):
        return plain_prompt(messages)
    own = {} if template == "auto" else {"chat_template": read_chat_template(template)}
    return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **own))
