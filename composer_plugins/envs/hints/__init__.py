"""Hint providers: turn an env's structured :class:`~composer_plugins.envs.base.Feedback` into a hint.

The hint is the "textual feedback" of targeted RL / hint self-distillation: it is inserted
into the context at the failing turn (:func:`build_teacher_context`) to form the teacher
context, under which the same model scores the student's attempt.

Built-ins, from cheapest to richest (registry kind ``hints``):

* ``template``: one fixed text per feedback kind (wrong answer, failing test with its
  assertion, syntax/runtime error, timeout, tool error, regression ...);
* ``raw_error``: the verifier's own words (assertion message, expected/actual, traceback);
* ``llm_teacher``: a teacher model writes a short hint from the problem, the attempt and the
  feedback. The teacher is built by name through the ``teachers`` registry, or is any object
  with ``async def complete(messages)`` (result with ``.text``) or a sync ``generate(messages)``.
  Off unless configured; falls back to ``template`` when the teacher fails;
* ``chain``: the first hint any of several providers gives;
* ``demonstration``: a successful sibling's completion from the same rollout group (SDPO's
  self-teacher), with the feedback when configured or when no sibling succeeded.

One contract (as simonw/llm's register hooks: one call shape, older shapes adapted once): a provider
gets one :class:`HintRequest` per row — prompt, completion, the env's feedback, the task, the reward and
the row's rollout group (:class:`SiblingGroup`) — and implements ``hints(requests) -> list[str | None]``
(:meth:`HintProvider.hint` per row is the simple form). A provider that reads the group says so with
``reads_groups = True``. Older providers (``hint(feedback, *, prompt, completion, task[, group])`` or
``hints(feedbacks, prompts, completions, tasks[, groups=])``, objects or plain callables) are adapted once
when the provider is built (:func:`build_hint_provider` / :func:`as_hint_provider`); nothing inspects a
signature per call.

Modules: :mod:`~composer_plugins.envs.hints.contract` (:class:`HintRequest`, :class:`SiblingGroup`,
:class:`HintProvider`, :func:`build_hint_provider` and the adapters of older shapes),
:mod:`~composer_plugins.envs.hints.feedback` (``template``, ``raw_error``),
:mod:`~composer_plugins.envs.hints.llm_teacher` (``llm_teacher``), :mod:`~composer_plugins.envs.hints.chain`
(``chain``), :mod:`~composer_plugins.envs.hints.demonstration` (``demonstration``) and
:mod:`~composer_plugins.envs.hints.context` (:func:`build_teacher_context`). ``step_check`` lives in
:mod:`composer_plugins.envs.step_check`. Import from this package.
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
