"""Teachers and multi-teacher trace replay.

* Teacher providers: ``openai`` (OpenAI-compatible HTTP), ``hf`` (local transformers), ``oracle``.
* :func:`load_traces` → :class:`TraceState` per student step (OpenAI messages / Claude Code JSONL).
* :class:`ReplayEngine`: async, per-teacher concurrency, retries, budget, persistent cache.
* :func:`extract_pairs` → preference pairs; :func:`normalize_pairs` runs the data-juicer recipe.
* ``scoring/``: teachers that score the student's rollout (on-policy distillation), a package: the contract
  (``contract``), the ``causal_lm`` scorer (``local``), the ``vllm``/``sglang`` scorers (``server``) and the
  background pool with its deadline (``pool``); a teacher with another tokenizer is mapped by ``align``.

Everything is imported lazily, so ``import composer_plugins.teachers`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Teacher": "base",
    "TeacherResponse": "base",
    "TeacherCallError": "base",
    "TeacherError": "base",
    "OpenAITeacher": "openai_compat",
    "HFTeacher": "hf",
    "OracleTeacher": "oracle",
    "TraceState": "traces",
    "TraceFormatError": "traces",
    "load_traces": "traces",
    "ReplayCache": "cache",
    "Budget": "budget",
    "ReplayEngine": "engine",
    "ReplayResult": "engine",
    "RetryPolicy": "engine",
    "replay": "engine",
    "extract_pairs": "pairs",
    "normalize_action": "pairs",
    "normalize_pairs": "normalize",
    "run_from_file": "runner",
    "run_replay": "runner",
    "ReplayConfig": "runner",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'composer_plugins.teachers' has no attribute {name!r}")
    return getattr(importlib.import_module(f"composer_plugins.teachers.{mod}"), name)
