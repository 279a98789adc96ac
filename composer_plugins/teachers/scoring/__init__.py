"""Teachers that **score** the student's rollout: top-k log-probs per completion token (on-policy distillation).

The contract is in ``contract``; ``causal_lm`` is :class:`LocalScorer` (``local``), ``vllm`` / ``sglang``
:class:`ServerScorer` (``server``); :class:`ScoringPool` (``pool``) runs them in the background. Details:
docs/losses.md ("Teachers that score", "Asynchronous"). Import from this package.
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
