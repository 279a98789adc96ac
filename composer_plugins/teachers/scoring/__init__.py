"""Teachers that **score** the student's rollout: top-k log-probs per completion token (on-policy distillation).

A scorer is given, per row, the prompt and the student's completion (text and token ids) and returns
:class:`TeacherScores`: per completion token, the teacher's ``K`` most likely next tokens (ids in the
**student's** vocabulary), their log-probs and a mask of the positions it scored. Kinds (``composer-plugins
list scorers``; third parties add more with ``register_teacher_scorers``): ``causal_lm`` (:class:`LocalScorer`
in ``local``: a frozen local model, top-k taken chunk by chunk through its LM head) and ``vllm`` / ``sglang``
(:class:`ServerScorer` in ``server``: prompt log-probs from a server, through the replay engine's transport,
cache, budget and retries). The contract is in ``contract``; a teacher with another tokenizer is mapped by
:mod:`composer_plugins.teachers.align`; :class:`ScoringPool` (``pool``) runs the scorers in the background
and collects them with a deadline. Details: docs/losses.md ("Teachers that score", "Asynchronous"). Import
from this package.
"""

from __future__ import annotations

from composer_plugins.teachers.scoring.contract import (
    ScoreRequest,
    ScorerStats,
    TeacherScorer,
    TeacherScores,
    same_vocabulary,
)
from composer_plugins.teachers.scoring.local import LocalScorer
from composer_plugins.teachers.scoring.pool import ScoringJob, ScoringPool, build_scorers
from composer_plugins.teachers.scoring.server import (
    Parsed,
    ScoringClient,
    ServerScorer,
    parse_sglang_input_logprobs,
    parse_vllm_prompt_logprobs,
)

__all__ = [
    "LocalScorer",
    "Parsed",
    "ScoreRequest",
    "ScorerStats",
    "ScoringClient",
    "ScoringJob",
    "ScoringPool",
    "ServerScorer",
    "TeacherScorer",
    "TeacherScores",
    "build_scorers",
    "parse_sglang_input_logprobs",
    "parse_vllm_prompt_logprobs",
    "same_vocabulary",
]
