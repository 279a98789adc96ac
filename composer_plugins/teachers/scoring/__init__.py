"""Teachers that **score** the student's rollout: top-k log-probs per completion token (on-policy distillation).

A scorer is given, per row, the prompt and the student's completion (text and the student's token
ids) and returns :class:`TeacherScores`: per student completion token, the teacher's ``K`` most
likely next tokens (ids in the **student's** vocabulary) and their log-probs, and a mask of the
positions it scored. Kinds (``composer-plugins list scorers``; third parties register more with
the ``register_teacher_scorers`` hook):

* ``causal_lm`` (:class:`LocalScorer`): a frozen ``from_pretrained`` causal LM (an id or a
  directory), optionally on its own device, batched; the top-k is taken from its hidden states
  chunk by chunk through its LM head (never ``rows × tokens × vocab``).
* ``vllm`` / ``sglang`` (:class:`ServerScorer`): an OpenAI-compatible server returning prompt
  log-probs (vLLM's ``/v1/completions`` with ``prompt_logprobs``; SGLang's ``/generate`` with
  ``return_logprob`` + ``top_logprobs_num``), through the replay engine: the same HTTP transport,
  cache (keyed by teacher, prompt, completion tokens and K), dollar budget, retries and
  fault accounting as replay.

A teacher whose tokenizer differs from the student's is mapped onto the student's tokens by
:mod:`composer_plugins.teachers.align`. :class:`ScoringPool` runs the scorers in the background
(started as soon as the rollouts exist) and collects them with a deadline: a teacher that has not
finished by then is skipped for that batch and reported.

Modules: :mod:`~composer_plugins.teachers.scoring.contract` (:class:`ScoreRequest`, :class:`TeacherScores`,
:class:`TeacherScorer`, the mapping onto the student's tokens), :mod:`~composer_plugins.teachers.scoring.local`
(``causal_lm``), :mod:`~composer_plugins.teachers.scoring.server` (``vllm`` / ``sglang``) and
:mod:`~composer_plugins.teachers.scoring.pool` (:class:`ScoringPool`, :func:`build_scorers`). Import from this
package.
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
