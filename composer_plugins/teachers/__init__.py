"""Teachers and multi-teacher trace replay.

* Teacher providers: ``openai`` (OpenAI-compatible HTTP), ``hf`` (local transformers), ``oracle``.
* :func:`load_traces` → :class:`TraceState` per student step (OpenAI messages / Claude Code JSONL).
* :class:`ReplayEngine`: async, per-teacher concurrency, retries, budget, persistent cache.
* :func:`extract_pairs` → preference pairs; :func:`normalize_pairs` runs the data-juicer recipe.
* ``scoring/``: teachers that score the student's rollout (on-policy distillation), a package of its own;
  a teacher with another tokenizer is mapped by ``align``.

Everything is imported lazily, so ``import composer_plugins.teachers`` stays cheap.
"""

from __future__ import annotations

from composer_plugins.core import lazy_exports

#: submodule -> the names imported lazily from it
_EXPORTS = {
    "base": ("Teacher", "TeacherResponse", "TeacherCallError", "TeacherError"),
    "openai_compat": ("OpenAITeacher",),
    "hf": ("HFTeacher",),
    "oracle": ("OracleTeacher",),
    "traces": ("TraceState", "TraceFormatError", "load_traces"),
    "cache": ("ReplayCache",),
    "budget": ("Budget",),
    "engine": ("ReplayEngine", "ReplayResult", "RetryPolicy", "replay"),
    "pairs": ("extract_pairs", "normalize_action"),
    "normalize": ("normalize_pairs",),
    "runner": ("run_from_file", "run_replay", "ReplayConfig"),
}

__all__ = sorted(n for names in _EXPORTS.values() for n in names)

__getattr__ = lazy_exports(__name__, _EXPORTS)
