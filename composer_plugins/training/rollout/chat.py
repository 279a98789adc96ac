"""Chat templates, applied in one place for every model input of the training stack.

Whatever the model reads (rollout and evaluation prompts, hinted teacher contexts, replay pairs' prompts,
SFT examples, conversations for external teachers) is made here with ``model.chat_template``
(:func:`composer_plugins.chat.render.render_prompt` renders). See docs/training.md "Chat models".
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from composer_plugins.chat.render import CHAT_MODES, is_conversation, read_chat_template, render_prompt
from composer_plugins.envs.hints import build_teacher_context

__all__ = [
    "PROMPT_KEYS",
    "check_chat_template",
    "hinted_context",
    "install_chat_template",
    "pair_prompt",
    "prompt_field",
    "render_prompt",
    "task_conversation",
    "task_prompt",
]

#: The task fields that hold the prompt, in order of preference.
PROMPT_KEYS = ("prompt", "question")


def prompt_field(task: Mapping[str, Any]) -> Any:
    """The prompt of a task dict as given: text, or a list of chat messages."""
    for k in PROMPT_KEYS:
        if k in task:
            return task[k]
    raise KeyError(f"task has no prompt field (expected one of {PROMPT_KEYS}); keys: {sorted(task)}")


def task_prompt(task: Mapping[str, Any], tokenizer: Any = None, template: str = "auto") -> str:
    """The text the model with ``tokenizer`` reads for ``task``.

    A text prompt is returned as it is; a list of chat messages is rendered with ``template``
    (``model.chat_template``: the tokenizer's chat template with the generation prompt under ``auto``;
    without a tokenizer, or with ``none``, plain text — never the Python repr of a list).
    """
    p = prompt_field(task)
    if is_conversation(p):
        return render_prompt(p, tokenizer, template)
    return str(p)


def task_conversation(task: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    """The task's chat messages, or ``None`` for a text prompt."""
    p = prompt_field(task)
    return [dict(m) for m in p] if is_conversation(p) else None


def hinted_context(prompt: Any, hint: str, tokenizer: Any = None, template: str = "auto") -> str:
    """The hinted teacher's context: ``hint`` inserted into ``prompt`` (text or messages), then rendered.

    A conversation gets the hint appended to its last user message (or a new user message), and is
    rendered with the same template as the student's prompt, so the teacher reads the student's
    context plus the hint and nothing else changes.
    """
    ctx = build_teacher_context(prompt if is_conversation(prompt) else str(prompt), hint)
    return render_prompt(ctx, tokenizer, template)


def pair_prompt(pair: Mapping[str, Any], tokenizer: Any = None, template: str = "auto") -> str:
    """A preference pair's prompt text: its ``messages`` rendered when a chat template applies, else ``prompt``.

    Pairs written by ``replay`` carry both (``prompt`` is the plain form of ``messages``); a pair whose
    ``prompt`` is itself a list of messages is rendered the same way.
    """
    msgs = pair.get("messages")
    p = pair.get("prompt")
    if is_conversation(p):
        return render_prompt(p, tokenizer, template)
    if is_conversation(msgs) and template != "none" and tokenizer is not None:
        if template != "auto" or getattr(tokenizer, "chat_template", None):
            return render_prompt(msgs, tokenizer, template)
    return str(p)


def check_chat_template(value: Any, src: Any, key: str) -> None:
    """``model.chat_template`` at load: ``auto``, ``none`` or a readable Jinja file that parses (located errors)."""
    if not isinstance(value, str) or not value.strip():
        raise src.error(key, f"expected auto, none or the path of a Jinja chat-template file, got {value!r}.")
    if value in CHAT_MODES:
        return
    if not os.path.isfile(value):
        raise src.error(
            key,
            f"no chat-template file {value!r} (from {os.getcwd()}); give auto (the tokenizer's template), "
            "none (plain text) or the path of a Jinja file.",
            valid=list(CHAT_MODES),
        )
    import jinja2

    try:
        jinja2.Environment().parse(read_chat_template(value))
    except (OSError, UnicodeDecodeError) as e:
        raise src.error(key, f"cannot read the chat template {value!r}: {e}.") from None
    except jinja2.TemplateSyntaxError as e:
        raise src.error(key, f"{value}:{e.lineno}: the chat template is not valid Jinja: {e.message}.") from None


def install_chat_template(tokenizer: Any, template: str) -> Any:
    """Set a ``model.chat_template`` file on ``tokenizer`` (``auto``/``none`` leave it as it is); returns it."""
    if template not in ("auto", "none") and tokenizer is not None:
        tokenizer.chat_template = read_chat_template(template)
    return tokenizer
