"""The ``teacher_distill`` channel's inputs: external teachers score the step's rollouts, in the background.

:func:`build_teacher_scoring` pools the scorers the live ``teacher_distill`` channels name;
:func:`score_requests` turns a record's rows into requests, which the experience maker submits as soon as the
rollouts are scored (the record holds the futures), so scoring overlaps the forwards. The ``teacher_scores``
input builder collects them up to ``StepPolicy.teacher_deadline_s`` (a late teacher is skipped and reported).
See docs/losses.md "On-policy distillation from external teachers".
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from tqdm import tqdm

from composer_plugins.training.rollout.chat import task_conversation
from composer_plugins.training.step.record import StepRecord

__all__ = [
    "build_teacher_scoring",
    "console_warning",
    "report_teacher_failures",
    "row_conversations",
    "score_requests",
    "teacher_channels",
    "teacher_summary",
]


def console_warning(line: str) -> None:
    """``warning: <line>`` on stderr, above a running progress bar (``tqdm.write``), never a silent log record."""

    tqdm.write(f"warning: {line}", file=sys.stderr)


def report_teacher_failures(pool: Any, reasons: Any = None) -> None:
    """Once per step: a console warning per teacher whose rows failed (or that was left out) in this step."""
    for line in pool.step_report(reasons) if pool is not None else ():
        console_warning(line)


def teacher_summary(pool: Any) -> None:
    """At the end of a run: one console line per teacher that failed at some step (failed rows, steps, reason)."""
    for line in pool.summary() if pool is not None else ():
        console_warning(line)


def teacher_channels(channels: Sequence[Any]) -> list[Any]:
    """The live channels that name scoring teachers (``teachers:`` of ``teacher_distill``)."""
    return [c for c in channels if getattr(c, "weight", 0.0) != 0.0 and getattr(c, "teachers", None)]


def build_teacher_scoring(channels: Sequence[Any], tokenizer: Any) -> Any:
    """A bound :class:`~composer_plugins.teachers.scoring.ScoringPool` of every live channel's teachers, or ``None``."""
    from composer_plugins.teachers.scoring import ScoringPool, build_scorers

    live = teacher_channels(channels)
    specs = [t for c in live for t in c.teachers]
    if not specs:
        return None
    pool = ScoringPool(build_scorers(specs))
    pool.bind(tokenizer)
    deadlines = [c.deadline_s for c in live if getattr(c, "deadline_s", None) is not None]
    pool.deadline_s = min(deadlines) if deadlines else None  # the shortest of the channels' deadlines
    return pool


def row_conversations(record: StepRecord) -> list[Any]:
    """Per row, the chat messages its prompt was rendered from (``None`` for a text prompt or unknown task)."""
    if not record.tasks:
        return [None] * record.num_rows
    convs = [task_conversation(t) for t in record.tasks]
    return [convs[g] if 0 <= g < len(convs) else None for g in record.row_groups]


def score_requests(
    record: StepRecord, chat_template: str = "auto", conversations: Sequence[Any] | None = None
) -> list[Any]:
    """One :class:`~composer_plugins.teachers.scoring.ScoreRequest` per row: prompt and completion, text and tokens.

    A row whose prompt was a conversation carries it (``messages``), so each teacher renders it with its
    own chat template; ``chat_template: none`` sends none (every teacher reads the plain prompt).
    ``conversations``: the rows' conversations when the record holds no tasks (a backend's micro-batch).
    """
    from composer_plugins.teachers.scoring import ScoreRequest

    convs = list(conversations) if conversations is not None else row_conversations(record)
    if chat_template == "none":
        convs = [None] * record.num_rows
    out = []
    for i in range(record.num_rows):
        p = record.prompt_ids[i][record.prompt_mask[i].bool()].tolist()
        n = int(record.completion_mask[i].nonzero().max()) + 1 if bool(record.completion_mask[i].any()) else 0
        if record.attention_mask is not None and bool(record.attention_mask[i].any()):
            n = max(n, int(record.attention_mask[i].nonzero().max()) + 1)
        c = record.completion_ids[i][:n].tolist()
        msgs = tuple(dict(m) for m in convs[i]) if convs[i] else None
        out.append(ScoreRequest(record.prompts[i], record.completions[i], tuple(c), tuple(p), msgs))
    return out
