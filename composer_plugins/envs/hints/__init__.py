"""Hint providers: turn an env's structured :class:`~composer_plugins.envs.base.Feedback` into a hint.

The hint (the "textual feedback" of hint self-distillation) goes into the teacher context at the failing turn
(:func:`build_teacher_context`). The built-ins are tabled in docs/envs.md, "Hints" (``step_check`` is in
:mod:`composer_plugins.envs.step_check`); the one provider contract (``contract``: a :class:`HintRequest` per
row, older shapes adapted once by :func:`build_hint_provider`) in docs/plugins.md, "register_hint_providers".
Import from this package.
"""

from __future__ import annotations

from composer_plugins.envs.hints.chain import ChainHintProvider
from composer_plugins.envs.hints.context import build_teacher_context
from composer_plugins.envs.hints.contract import (
    HintProvider,
    HintRequest,
    SiblingGroup,
    as_hint_provider,
    build_hint_provider,
    hint_requests,
    reads_groups,
    sibling_groups,
)
from composer_plugins.envs.hints.demonstration import (
    DEMONSTRATION_TEMPLATE,
    FEEDBACK_TEMPLATE,
    DemonstrationHintProvider,
)
from composer_plugins.envs.hints.feedback import DEFAULT_TEMPLATES, RawErrorHintProvider, TemplateHintProvider
from composer_plugins.envs.hints.llm_teacher import HINT_SYSTEM_PROMPT, LLMTeacherHintProvider, hint_request_messages

__all__ = [
    "DEFAULT_TEMPLATES",
    "DEMONSTRATION_TEMPLATE",
    "FEEDBACK_TEMPLATE",
    "HINT_SYSTEM_PROMPT",
    "ChainHintProvider",
    "DemonstrationHintProvider",
    "HintProvider",
    "HintRequest",
    "LLMTeacherHintProvider",
    "RawErrorHintProvider",
    "SiblingGroup",
    "TemplateHintProvider",
    "as_hint_provider",
    "build_hint_provider",
    "build_teacher_context",
    "hint_request_messages",
    "hint_requests",
    "reads_groups",
    "sibling_groups",
]
